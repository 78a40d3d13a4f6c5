"""sample kernel on the GPU vs the distribution pagedkern.reference.sample defines: frequencies
over 2^20 draws per configuration against the exact renormalised top-k/top-p probabilities
(float64 model in test_decode_algorithms), at V = 1000 and at Llama 3's V = 128256 (top-k, top-p,
bf16 rows with +-inf and ties), every draw inside the kept set, greedy = argmax,
NaN/inf/tie rows, reproducibility and independence of the batch, per-row parameter arrays,
every logits dtype, odd vocabularies, and draw-for-draw agreement with the reference (the kernel
uses the same u and the same inverse CDF in vocabulary order), and at small batch (v4 splits a
row over several CTAs) the ids of one CTA per row exactly. Every test runs every kernel variant
(PAGEDKERN_KERNELS=sample:v4, v3 and v2) until a GPU run has verified v4 and v3."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_check import every_variant
from test_decode_algorithms import _expected

import pagedkern
from pagedkern import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
N_DRAWS = 1 << 20
VOCAB = 1000

kernel_variant = every_variant("sample")  # v4, v3 and v2


def _row(kind: str, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2
    if kind == "ties":
        x = x.round()
    elif kind == "nan":
        x[torch.randperm(vocab, generator=g)[:100]] = math.nan
    elif kind == "posinf":
        x[[4, vocab // 2, vocab - 1]] = math.inf
    elif kind == "peaked":
        x = x * 4
    elif kind == "neginf_ties":  # ties, -0.0 and a third of the vocabulary at -inf
        x = (x * 2).round()
        x[x == 0] = -0.0
        x[torch.randperm(vocab, generator=g)[: vocab // 3]] = -math.inf
    elif kind == "inf_ties":  # +inf ties beside -inf and finite ties: the +inf ids share it all
        x = x.round()
        x[torch.randperm(vocab, generator=g)[: vocab // 3]] = -math.inf
        x[[7, vocab // 3, vocab - 2]] = math.inf
    return x


# (row kind, temperature, top_p, top_k)
DISTRIBUTIONS = [
    ("plain", 1.0, 1.0, 0),
    ("plain", 0.7, 1.0, 50),
    ("plain", 1.3, 0.9, -1),
    ("peaked", 1.0, 0.95, 100),
    ("ties", 1.0, 0.6, 0),
    ("ties", 0.5, 1.0, 7),
    ("nan", 1.0, 0.8, 30),
    ("posinf", 2.0, 0.3, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, temperature, top_p, top_k", DISTRIBUTIONS)
def test_frequencies_match_the_renormalised_distribution(kind, temperature, top_p, top_k, dtype):
    row = _row(kind, seed=len(kind)).to(dtype)
    expected = _expected(row.float(), temperature, top_p, top_k)
    logits = row.to(DEVICE).expand(N_DRAWS, VOCAB)  # one row, 2^20 draws (row stride 0)
    seeds = torch.arange(N_DRAWS, device=DEVICE) * 1000003 + 12345
    ids = pagedkern.sample(logits, temperature, top_p, top_k, seeds, offsets=7)
    freq = torch.bincount(ids.long(), minlength=VOCAB).double().cpu() / N_DRAWS
    assert (freq[expected == 0] == 0).all(), "a draw outside the top-k/top-p set"
    cosine = float(freq @ expected / (freq.norm() * expected.norm()))
    assert cosine > 0.99
    # Total variation: P(TV >= eps) <= 2^K exp(-2 N eps^2) for K kept tokens (Bretagnolle-Huber-
    # Carol); eps at a 1e-9 false-alarm rate.
    kept = int((expected > 0).sum())
    bound = math.sqrt((kept * math.log(2) + math.log(1e9)) / (2 * N_DRAWS))
    assert 0.5 * float((freq - expected).abs().sum()) < bound


def _expected_large(row, temperature, top_p, top_k):
    """test_decode_algorithms._expected with the top-p masses from one sort (O(V log V) instead
    of O(V^2), for V = 128256): mass above token i = sum of the probabilities strictly larger."""
    x = row.double().clone()
    x[x.isnan()] = -math.inf
    if (x == math.inf).any():
        return (x == math.inf).double() / (x == math.inf).sum()
    s = (row.float() / temperature).double()
    s[row.isnan()] = -math.inf
    if 0 < top_k < x.numel():
        s[s < s.sort(descending=True).values[top_k - 1]] = -math.inf
    p = torch.exp(s - s.max())
    p /= p.sum()
    if top_p < 1:
        values, order = p.sort(descending=True)
        first = torch.searchsorted(-values, -values, side="left")  # start of each tie group
        cumulative = values.cumsum(0)
        above = torch.empty_like(p)
        above[order] = torch.where(first > 0, cumulative[(first - 1).clamp(min=0)], 0.0)
        p[(above >= top_p) & (above > 0)] = 0
        p /= p.sum()
    return p


LLAMA3_VOCAB = 128256
# (row kind, dtype, temperature, top_p, top_k) at Llama 3's vocabulary size.
LARGE_VOCAB = [
    ("plain", torch.float32, 0.7, 1.0, 50),  # top-k: 50 kept
    ("plain", torch.float32, 0.5, 0.9, 0),  # top-p: ~720 kept
    ("peaked", torch.bfloat16, 3.0, 0.95, 1000),  # both: ~860 kept
    ("neginf_ties", torch.bfloat16, 1.0, 0.7, 0),
    ("neginf_ties", torch.bfloat16, 0.8, 1.0, 20),
    ("inf_ties", torch.bfloat16, 1.0, 0.5, 2),
]


@pytest.mark.parametrize("kind, dtype, temperature, top_p, top_k", LARGE_VOCAB)
def test_frequencies_at_llama3_vocabulary(kind, dtype, temperature, top_p, top_k):
    # The kernel's block-wide top-k / top-p over 128256 entries: ties at the cut, -0.0, +-inf.
    row = _row(kind, seed=len(kind) + top_k, vocab=LLAMA3_VOCAB).to(dtype)
    expected = _expected_large(row.float(), temperature, top_p, top_k)
    logits = row.to(DEVICE).expand(N_DRAWS, LLAMA3_VOCAB)
    seeds = torch.arange(N_DRAWS, device=DEVICE) * 1000003 + 99
    ids = pagedkern.sample(logits, temperature, top_p, top_k, seeds, offsets=3)
    freq = torch.bincount(ids.long(), minlength=LLAMA3_VOCAB).double().cpu() / N_DRAWS
    assert (freq[expected == 0] == 0).all(), "a draw outside the top-k/top-p set"
    kept = int((expected > 0).sum())
    assert kept < 5000, "the case keeps too many tokens for 2^20 draws to resolve"
    bound = math.sqrt((kept * math.log(2) + math.log(1e9)) / (2 * N_DRAWS))
    assert 0.5 * float((freq - expected).abs().sum()) < bound


def test_greedy_is_the_first_argmax():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    logits = torch.randn(64, 128256, generator=g, device=DEVICE)
    logits[0, [5, 77, 90000]] = 50.0  # ties: the lowest id
    logits[1, ::2] = math.nan
    logits[2, [3, 9]] = math.inf
    logits[3] = -math.inf
    logits[4] = math.nan
    expected = torch.nan_to_num(logits, nan=-math.inf).argmax(-1).int()
    for temperature in (0.0, -1.0):
        ids = pagedkern.sample(logits, temperature, 0.9, 40, 123)
        assert torch.equal(ids, expected)
    ids = pagedkern.sample(logits, 1e-37, 1.0, 0, 123)  # row 0 overflows: greedy; row 1 is
    rows = [0, 1, 3, 4]  # sharp enough to be greedy; 3 and 4 have nothing finite (row 2: +inf)
    assert torch.equal(ids[rows], expected[rows])


def _mixed_batch(rows, vocab, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g, device=DEVICE) * 3).to(dtype)
    logits[::9] = logits[::9].round()  # tie-heavy rows
    logits[1::9, ::13] = math.nan
    logits[2::9, 7] = math.inf
    logits[3::9] = -math.inf
    params = dict(
        temperature=torch.rand(rows, generator=g, device=DEVICE) * 1.5,
        top_p=torch.rand(rows, generator=g, device=DEVICE) * 1.2,
        top_k=torch.randint(-2, 80, (rows,), generator=g, device=DEVICE, dtype=torch.int32),
        seeds=torch.randint(0, 2**62, (rows,), generator=g, device=DEVICE),
        offsets=torch.randint(0, 2**40, (rows,), generator=g, device=DEVICE),
    )
    params["temperature"][::11] = 0.0
    return logits, params


@pytest.mark.parametrize(
    "dtype, vocab",
    [(torch.float32, 32000), (torch.bfloat16, 32000), (torch.float16, 4097), (torch.float32, 4099)],
)
def test_draws_equal_the_reference_draws(dtype, vocab):
    # Same u, same inverse CDF in vocabulary order: ids agree with the reference except where a
    # cumulative sum lands within rounding of u (fp64 of fp32 probabilities vs exact fixed point).
    logits, params = _mixed_batch(512, vocab, dtype, seed=vocab)
    ids = pagedkern.sample(logits, **params)
    ref = reference.sample(logits, **params)
    assert ids.dtype == torch.int32 and ((ids >= 0) & (ids < vocab)).all()
    agree = float((ids == ref).double().mean())
    assert agree >= 0.99, f"only {agree:.2%} of the draws equal the reference's"


def test_reproducible_and_independent_of_the_batch():
    logits, params = _mixed_batch(96, 5000, torch.float32, seed=3)
    ids = pagedkern.sample(logits, **params)
    assert torch.equal(ids, pagedkern.sample(logits, **params))
    order = torch.randperm(96, device=DEVICE)
    extra, extra_params = _mixed_batch(96, 5000, torch.float32, seed=4)
    mixed = torch.cat([logits[order], extra])
    mixed_params = {k: torch.cat([v[order], extra_params[k]]) for k, v in params.items()}
    assert torch.equal(pagedkern.sample(mixed, **mixed_params)[:96], ids[order])


def test_scalar_parameters_equal_per_row_arrays_and_out():
    logits, _ = _mixed_batch(40, 3000, torch.bfloat16, seed=5)
    rows = logits.shape[0]
    scalar = pagedkern.sample(logits, 0.8, 0.9, 40, 1234, 5)
    arrays = pagedkern.sample(
        logits,
        torch.full((rows,), 0.8, device=DEVICE),
        torch.full((rows,), 0.9, device=DEVICE),
        torch.full((rows,), 40, dtype=torch.int32, device=DEVICE),
        torch.full((rows,), 1234, device=DEVICE),
        torch.full((rows,), 5, device=DEVICE),
    )
    assert torch.equal(scalar, arrays)
    out = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    assert pagedkern.sample(logits, 0.8, 0.9, 40, 1234, 5, out=out) is out
    assert torch.equal(out, scalar)
    # Offsets move the draw: different ids across offsets of one seed.
    flat = torch.zeros(200, 1000, device=DEVICE)
    by_offset = pagedkern.sample(flat, 1.0, 1.0, 0, 42, torch.arange(200, device=DEVICE))
    assert by_offset.unique().numel() > 150


def _processing_inputs(rows, vocab, seed):
    """Every processing input (tests/test_kernels_emulated.py builds the same kind on the CPU)."""
    from test_kernels_emulated import _processing_case

    g = torch.Generator().manual_seed(seed)
    return {k: v.to(DEVICE) for k, v in _processing_case(rows, vocab, g).items()}


@pytest.mark.parametrize(
    "dtype, vocab", [(torch.float32, 128256), (torch.bfloat16, 128256), (torch.float16, 4099)]
)
def test_processed_draws_and_logprobs_equal_the_reference(dtype, vocab):
    # The processing stage + passes on the GPU vs reference.sample with the same inputs
    # (penalties, bias, bans, bitmask, min-p): ids agree except within rounding of u, and the
    # sampled token's logprob agrees within 1e-4.
    rows = 256
    logits, params = _mixed_batch(rows, vocab, dtype, seed=vocab + 7)
    processing = _processing_inputs(rows, vocab, seed=vocab)
    out = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    lp = torch.full((rows,), float("nan"), device=DEVICE)
    pagedkern.sample(logits, **params, out=out, logprobs=lp, **processing)
    ref_lp = torch.full((rows,), float("nan"), device=DEVICE)
    ref = reference.sample(logits, **params, logprobs=ref_lp, **processing)
    assert ((out >= 0) & (out < vocab)).all()
    agree = float((out == ref).double().mean())
    assert agree >= 0.99, f"only {agree:.2%} of the processed draws equal the reference's"
    same = out == ref
    torch.testing.assert_close(lp[same], ref_lp[same], rtol=0, atol=1e-4)
    # a banned (-inf bias) or masked token is never drawn (unless the whole row is -inf)
    kept = {k: v for k, v in processing.items() if k != "min_p"}
    x = reference.logits_processing.process_logits(logits, **kept)
    drawn = x.gather(1, out.long()[:, None])[:, 0]
    assert ((drawn > -math.inf) | (x == -math.inf).all(-1)).all()


@pytest.mark.parametrize("dtype, vocab", [(torch.float32, 128256), (torch.bfloat16, 128256)])
def test_top_logprobs_equal_the_reference(dtype, vocab):
    # v3 computes the top-20 in the kernel, v2 with torch ops: both against the reference's
    # stable sort of the processed log-softmax (values within 1e-4, ids equal but for rows
    # whose ranks differ only by rounding), greedy rows' top-1 = the sampled token.
    rows, n = 256, 20
    logits, params = _mixed_batch(rows, vocab, dtype, seed=vocab + 11)
    processing = _processing_inputs(rows, vocab, seed=vocab + 1)
    out = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    lp = torch.full((rows,), float("nan"), device=DEVICE)
    top_ids = torch.full((rows, n), -1, dtype=torch.int32, device=DEVICE)
    top = torch.full((rows, n), float("nan"), device=DEVICE)
    pagedkern.sample(
        logits, **params, out=out, logprobs=lp, top_ids=top_ids, top_logprobs=top, **processing
    )
    ref_ids = torch.zeros_like(top_ids)
    ref_top = torch.zeros_like(top)
    reference.sample(logits, **params, top_ids=ref_ids, top_logprobs_out=ref_top, **processing)
    assert not top.isnan().any() and (top <= 0).all()
    assert (top[:, 1:] <= top[:, :-1]).all(), "top-N in descending order"
    torch.testing.assert_close(top, ref_top, rtol=0, atol=1e-4)
    same_rows = float((top_ids == ref_ids).all(-1).double().mean())
    assert same_rows >= 0.99, f"only {same_rows:.2%} of the rows have the reference's top ids"
    greedy = params["temperature"] <= 0
    assert torch.equal(top_ids[greedy, 0], out[greedy])
    torch.testing.assert_close(top[greedy, 0], lp[greedy], rtol=0, atol=0)


@pytest.mark.parametrize(
    "dtype, vocab", [(torch.float32, 128256), (torch.bfloat16, 50257), (torch.float16, 4097)]
)
@pytest.mark.parametrize("rows", [1, 4, 8, 131])
def test_small_batches_draw_exactly_what_one_cta_per_row_draws(
    dtype, vocab, rows, kernels, kernel_variant
):
    # v4 splits these rows over several CTAs (ops.sampling.split_slices; 131 rows: one CTA per
    # row on a 132-SM H200): integer merges, so its ids are v3's bit for bit, with and without
    # processing, and the reference's but for draws within rounding of u.
    logits, params = _mixed_batch(rows, vocab, dtype, seed=vocab + rows)
    processing = _processing_inputs(rows, vocab, seed=rows)
    for extra in ({}, processing):
        out = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
        pagedkern.sample(logits, **params, out=out, **extra)
        kernels(sample="v3")
        one_cta = pagedkern.sample(logits, **params, **extra)
        kernels(sample=kernel_variant)
        assert torch.equal(out, one_cta)
        ref = reference.sample(logits, **params, **extra)
        assert int((out != ref).sum()) <= max(1, rows // 50)
