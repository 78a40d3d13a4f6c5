"""The reference Philox RNG and `sample` against known answers and an independent float64 model.

`_expected_probs` restates the module docstring's semantics in float64 (NaN = -inf, +inf rows
uniform over their +inf entries, top-k with ties kept, top-p on "mass strictly more probable than
the token", renormalised). Sampling tests then check support (no draw outside that set), frequencies
over many seeds, and reproducibility. Seeds are fixed, so every test is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkern import ops
from pagedkern.reference import philox4x32, sample
from pagedkern.reference.sampling import uniform

M32 = 0xFFFFFFFF


def _philox_py(counter, key, rounds=10):
    """Philox4x32-R in plain Python integers (Salmon et al., Random123)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32(
        tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key)
    )
    assert tuple(int(w) for w in words) == expected
    assert _philox_py(counter, key) == expected  # validates the independent model too


def test_philox_vectorised_matches_python_model():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (6, 500), generator=g, dtype=torch.int64)
    out = philox4x32(tuple(words[:4]), tuple(words[4:]))
    for i in range(0, 500, 7):
        col = [int(w) for w in words[:, i]]
        assert tuple(int(o[i]) for o in out) == _philox_py(col[:4], col[4:])


def test_uniform_is_first_philox_word_over_2_32():
    # counter = (offset lo, offset hi, 0, 0), key = (seed lo, seed hi): high words matter too.
    seeds = torch.tensor([0, 1, 2**32 + 1, 2**40 + 12345, 2**62 + 99])
    offsets = torch.tensor([0, 7, 7, 2**33 + 5, 123456789])
    u = uniform(seeds, offsets)
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    for s, o, ui in zip(seeds.tolist(), offsets.tolist(), u.tolist()):
        word = _philox_py((o & M32, o >> 32, 0, 0), (s & M32, s >> 32))[0]
        assert ui == word / 2**32
    assert u[1] != u[2], "seed 1 and 2^32 + 1 must differ (high key word)"


def _expected_probs(logits_row, temperature, top_p, top_k):
    """Exact float64 sampling distribution of one row, following the module docstring."""
    x = logits_row.double().clone()
    x[x.isnan()] = -math.inf
    vocab = x.numel()
    if temperature <= 0 or not (x > -math.inf).any():
        p = torch.zeros(vocab, dtype=torch.float64)  # greedy: first maximum, id 0 if none
        p[int((x == x.max()).nonzero()[0])] = 1.0
        return p
    if (x == math.inf).any():
        return (x == math.inf).double() / (x == math.inf).sum()
    s = x / temperature
    if 0 < top_k < vocab:
        kth = s.sort(descending=True).values[top_k - 1]
        s[s < kth] = -math.inf  # ties with the k-th largest stay
    p = torch.exp(s - s.max())
    p /= p.sum()
    if top_p < 1:
        above = torch.stack([p[p > pi].sum() for pi in p])  # mass strictly more probable
        assert ((above - top_p).abs() > 1e-5).all(), "test input too close to the top-p cut"
        p[(above >= top_p) & (above > 0)] = 0
        p /= p.sum()
    return p


def _random_logits(rows, vocab, g, quantum=None):
    x = torch.randn(rows, vocab, generator=g) * 2
    if quantum:  # coarse grid: many exact ties (exact in fp32, and after dyadic temperatures)
        x = (x / quantum).round() * quantum
    return x


def test_greedy_is_first_argmax():
    g = torch.Generator().manual_seed(1)
    logits = _random_logits(6, 50, g, quantum=0.5)
    logits[0, [3, 17, 40]] = 100.0  # tie at the maximum: lowest id wins
    logits[1, 0], logits[1, 9] = float("nan"), 50.0  # NaN is -inf, not a maximum
    logits[2, [5, 8]] = float("inf")  # +inf: first one
    logits[3] = -math.inf  # nothing finite: id 0
    logits[4] = float("nan")
    logits[5, :] = -math.inf
    logits[5, 33] = -1e30
    temps = torch.tensor([0.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    ids = sample(logits, temps, 0.5, 3, torch.arange(6))
    assert ids.dtype == torch.int32 and ids.tolist() == [3, 9, 5, 0, 0, 33]


def test_support_stays_in_the_allowed_set():
    # 48 rows of tie-heavy logits with mixed per-row parameters, each drawn under 300 seeds.
    g = torch.Generator().manual_seed(2)
    rows, vocab, draws = 48, 100, 300
    logits = _random_logits(rows, vocab, g, quantum=0.25)
    logits[0:4, :10] = float("nan")
    temps = torch.tensor([0.5, 1.0, 2.0, 0.75])[torch.randint(0, 4, (rows,), generator=g)]
    top_ks = torch.tensor([-1, 0, 1, 5, 50, 100, 150])[torch.randint(0, 7, (rows,), generator=g)]
    top_ps = torch.tensor([0.1, 0.5, 0.9, 1.0, 1.5])[torch.randint(0, 5, (rows,), generator=g)]
    rep = torch.arange(rows).repeat_interleave(draws)
    seeds = torch.arange(rows * draws) * 7919 + 17
    ids = sample(logits[rep], temps[rep], top_ps[rep], top_ks[rep], seeds, offsets=3)
    assert ids.shape == (rows * draws,)
    for r in range(rows):
        p = _expected_probs(logits[r], temps[r].item(), top_ps[r].item(), int(top_ks[r]))
        drawn = ids[r * draws : (r + 1) * draws].long()
        assert (p[drawn] > 0).all(), f"row {r} drew outside its top-k/top-p set"
        if p.max() < 1:  # a real choice: the draws are not all the same
            assert drawn.unique().numel() > 1


N_DRAWS = 20000
# Total-variation bound: for K categories and N draws, P(TV >= eps) <= 2^K exp(-2 N eps^2)
# (Bretagnolle-Huber-Carol). With K = vocab = 64, N = 20000 and eps below, that is < 1e-9 for
# a correct sampler; a shifted id, a wrong temperature or a missing filter moves TV well past it.
VOCAB = 64
TV_BOUND = math.sqrt((VOCAB * math.log(2) + math.log(1e9)) / (2 * N_DRAWS))  # ~0.040

CASES = {
    "plain": dict(temperature=1.0, top_p=1.0, top_k=0),
    "cold_top_k": dict(temperature=0.7, top_p=1.0, top_k=10),
    "hot_top_p": dict(temperature=1.25, top_p=0.8, top_k=-1),
    "top_k_and_p": dict(temperature=1.0, top_p=0.6, top_k=20),
    "ties_top_k": dict(temperature=1.0, top_p=1.0, top_k=5, quantum=1.0),
    "ties_top_p": dict(temperature=0.5, top_p=0.5, top_k=0, quantum=1.0),
    "nan_entries": dict(temperature=1.0, top_p=0.95, top_k=0, nan=True),
    "posinf_entries": dict(temperature=2.0, top_p=0.3, top_k=1, posinf=True),
}


@pytest.mark.parametrize("case", CASES)
def test_frequencies_match_the_exact_distribution(case):
    cfg = dict(CASES[case])
    g = torch.Generator().manual_seed(3)
    row = _random_logits(1, VOCAB, g, quantum=cfg.pop("quantum", None))[0]
    if cfg.pop("nan", False):
        row[torch.randperm(VOCAB, generator=g)[:8]] = float("nan")
    if cfg.pop("posinf", False):
        row[[4, 20, 51]] = float("inf")
        row[7] = float("nan")
    p = _expected_probs(row, **cfg)
    seeds = torch.arange(N_DRAWS, dtype=torch.int64) * 104729 + 2**33
    ids = sample(row.expand(N_DRAWS, VOCAB), seeds=seeds, offsets=11, **cfg)
    freq = torch.bincount(ids.long(), minlength=VOCAB).double() / N_DRAWS
    assert (freq[p == 0] == 0).all(), "drew a token outside the allowed set"
    tv = 0.5 * (freq - p).abs().sum().item()
    assert tv < TV_BOUND, f"total variation {tv:.4f} >= {TV_BOUND:.4f}"
    # Per token, within 6 binomial standard deviations: catches a single token's error that
    # is too small to move TV past its bound (+3 counts of slack for rare tokens, where the
    # normal approximation is poor).
    sigma = torch.sqrt(p * (1 - p) / N_DRAWS)
    assert ((freq - p).abs() <= 6 * sigma + 3 / N_DRAWS).all()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_rows_without_a_finite_logit_fall_back_to_greedy(top_p):
    rows = torch.full((6, 10), -math.inf)
    rows[1] = float("nan")
    rows[2, 6] = float("inf")  # one +inf among -inf: always that one
    rows[3, 2] = -5.0  # one finite: always that one
    rows[4] = torch.linspace(-3.0, 3.0, 10)  # an ordinary row in the same batch
    rows[5, :4] = torch.tensor([1.0, 5.0, 100.0, -3.0])  # 100 / 1e-37 overflows fp32: greedy
    temps = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1e-37]).repeat(50)
    ids = sample(rows.repeat(50, 1), temps, top_p, 0, torch.arange(300)).view(50, 6)
    assert ids[:, [0, 1, 2, 3, 5]].tolist() == [[0, 0, 6, 2, 2]] * 50
    assert ids[:, 4].unique().numel() > 3


def test_same_seed_and_offset_give_the_same_id_in_any_batch():
    g = torch.Generator().manual_seed(4)
    rows, vocab = 12, 200
    logits = _random_logits(rows, vocab, g)
    temps = torch.rand(rows, generator=g) + 0.3
    temps[0] = 0.0
    top_ps = torch.rand(rows, generator=g) * 0.5 + 0.5
    top_ks = torch.randint(0, 60, (rows,), generator=g)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    offsets = torch.randint(0, 1000, (rows,), generator=g)
    ids = sample(logits, temps, top_ps, top_ks, seeds, offsets)
    # Reversed order with unrelated rows interleaved.
    extra = _random_logits(rows, vocab, g)
    order = torch.arange(rows).flip(0)
    mixed = torch.stack([logits[order], extra], 1).reshape(2 * rows, vocab)

    def mix(a, b):
        return torch.stack([a[order], b], 1).reshape(-1)

    ids2 = sample(
        mixed,
        mix(temps, temps.flip(0)),
        mix(top_ps, top_ps),
        mix(top_ks, top_ks),
        mix(seeds, seeds + 1),
        mix(offsets, offsets + 5),
    )
    assert torch.equal(ids2[0::2], ids[order])
    for r in range(rows):  # and alone, with scalar parameters
        one = sample(
            logits[r : r + 1],
            temps[r].item(),
            top_ps[r].item(),
            int(top_ks[r]),
            int(seeds[r]),
            int(offsets[r]),
        )
        assert one.item() == ids[r].item()


def test_different_offsets_and_seeds_give_different_draws():
    g = torch.Generator().manual_seed(5)
    logits = _random_logits(1, 1000, g) * 0.05  # nearly uniform over 1000 ids
    many = logits.expand(200, 1000)
    by_offset = sample(many, 1.0, 1.0, 0, seeds=42, offsets=torch.arange(200))
    by_seed = sample(many, 1.0, 1.0, 0, seeds=torch.arange(200) + 2**32, offsets=0)
    # About 181 distinct ids are expected from 200 uniform draws out of 1000.
    assert by_offset.unique().numel() > 150 and by_seed.unique().numel() > 150
    assert not torch.equal(by_offset, by_seed)


def test_scalar_and_per_row_parameters_agree():
    g = torch.Generator().manual_seed(6)
    logits = _random_logits(32, 300, g)
    scalar = sample(logits, 0.8, 0.9, 40, 1234, 5)
    rows = 32
    per_row = sample(
        logits,
        torch.full((rows,), 0.8, dtype=torch.float64),
        torch.full((rows,), 0.9),
        torch.full((rows,), 40, dtype=torch.int32),
        torch.full((rows,), 1234),
        torch.full((rows,), 5),
    )
    assert torch.equal(scalar, per_row)
    out = torch.full((rows,), -1, dtype=torch.int32)  # poisoned out
    assert sample(logits, 0.8, 0.9, 40, 1234, 5, out=out) is out
    assert torch.equal(out, scalar)


@pytest.mark.parametrize("off_k, off_p", [(-1, 1.0), (-3, 1.0), (300, 1.0), (0, 1.5), (1000, 2.0)])
def test_disabled_filters_are_the_same_as_no_filter(off_k, off_p):
    # k <= 0 or k >= vocab, and p >= 1, turn the filters off: same draws as plain sampling.
    g = torch.Generator().manual_seed(7)
    logits = _random_logits(64, 300, g)
    seeds = torch.arange(64) * 31
    plain = sample(logits, 1.0, 1.0, 0, seeds)
    assert torch.equal(sample(logits, 1.0, off_p, off_k, seeds), plain)


def _entries(offsets, ids, rows=3):
    """ops.sample's sparse processing arrays: bias-only entries of +100 at `ids`."""
    n = len(ids)
    return {
        "token_offsets": torch.tensor(offsets, dtype=torch.int32),
        "token_ids": torch.tensor(ids, dtype=torch.int32),
        "token_counts": torch.full((n,), -1, dtype=torch.int32),
        "token_bias": torch.full((n,), 100.0),
        "presence_penalty": torch.zeros(rows),
        "frequency_penalty": torch.zeros(rows),
        "repetition_penalty": torch.ones(rows),
    }


def _mask_rows(rows):
    return {
        "bitmask": torch.full((2, 2), -1, dtype=torch.int32),
        "bitmask_rows": torch.tensor(rows, dtype=torch.int32),
    }


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize(
    "processing, message",
    [
        pytest.param(
            _entries([0, 1, 1, 1], [-1]),
            r"token_ids\[0\] = -1 is not a token id .*\[0, 50\)",
            id="negative id",
        ),
        pytest.param(
            _entries([0, 1, 2, 2], [3, 50]),
            r"token_ids\[1\] = 50 is not a token id .*\[0, 50\)",
            id="id past the vocabulary",
        ),
        pytest.param(
            _entries([1, 2, 2, 2], [3, 4]),
            r"token_offsets\[0\] = 1 must be 0",
            id="offsets not from 0",
        ),
        pytest.param(
            _entries([0, 2, 1, 2], [3, 4]),
            r"token_offsets\[2\] = 1 < token_offsets\[1\] = 2",
            id="decreasing offsets",
        ),
        pytest.param(
            _entries([0, 1, 1, 1], [3, 4]),
            r"token_offsets\[3\] = 1 must equal .* entries 2",
            id="offsets not ending at nnz",
        ),
        pytest.param(
            _mask_rows([0, 2, -1]),
            r"bitmask_rows\[1\] = 2 is neither negative .*\[0, 2\)",
            id="mask row past the bitmask",
        ),
    ],
)
def test_ops_sample_refuses_processing_indices_outside_their_ranges(backend, processing, message):
    """Checked before the reference follows them: a negative id wrapped onto the last token,
    a bad offset gave another row's entries or a raw torch error."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    with ops.use_backend(backend), pytest.raises(ValueError, match=message):
        ops.sample(logits, 0.0, 1.0, 0, 0, **processing)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_ops_sample_takes_any_negative_bitmask_row_as_no_mask(backend):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    with ops.use_backend(backend):
        ids = ops.sample(logits, 0.0, 1.0, 0, 0, **_mask_rows([-5, -1, -(2**31)]))
    assert torch.equal(ids, logits.argmax(-1).int())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize(
    "name, value", [("seeds", 2**63), ("seeds", -(2**63) - 1), ("offsets", 2**64)]
)
def test_ops_sample_refuses_seeds_and_offsets_outside_int64(backend, name, value):
    args = {"seeds": 1, "offsets": 0, name: value}
    with (
        ops.use_backend(backend),
        pytest.raises(ValueError, match=rf"{name} = {value} is outside the int64 range"),
    ):
        ops.sample(torch.randn(2, 50), 1.0, 1.0, 0, args["seeds"], args["offsets"])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_ops_sample_takes_a_top_k_past_int32_as_off(backend):
    """k >= vocab and k <= 0 are off, as in the kernel, which takes k clamped into int32."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    seeds = torch.arange(4) * 17
    with ops.use_backend(backend):
        off = ops.sample(logits, 1.0, 1.0, 0, seeds)
        assert torch.equal(ops.sample(logits, 1.0, 1.0, 2**70, seeds), off)
        assert torch.equal(ops.sample(logits, 1.0, 1.0, -(2**70), seeds), off)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_ops_sample_takes_zero_top_logprobs(backend):
    """top_ids / top_logprobs [B, 0] ask for none (an empty array's strides are arbitrary)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    lp = torch.full((3,), math.nan)
    with ops.use_backend(backend):
        ids = ops.sample(
            logits, 0.0, 1.0, 0, 0, logprobs=lp, top_ids=torch.empty(3, 0, dtype=torch.int32),
            top_logprobs=torch.empty(3, 0),
        )  # fmt: skip
    assert torch.equal(ids, logits.argmax(-1).int())
    want = torch.log_softmax(logits, -1).gather(1, ids.long()[:, None])[:, 0]
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)
