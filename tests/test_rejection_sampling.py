"""reference.rejection_sample (speculative verification) on the CPU: request for request against an
independent float64 formulation written here (batched tensor ops, not the reference's loop); the
exact-distribution property over 2^16 seeds (emitted token j, given the proposals before it were
accepted, is distributed as the target at position j) for point-mass and random drafts, with
targets processed by reference.sampling_distribution; greedy; k = 0 = reference.sample; and the
argument checks of ops.rejection_sample. The 2^16-seed runs use the formulation (the reference's
Python loop costs ~0.7 ms per request here); each of them also checks its first requests against
the reference itself, so the property holds for the reference by that agreement."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkern import ops, reference
from pagedkern.reference.sampling import philox4x32

N_SEEDS = 1 << 16


def independent_rejection_sample(target, draft_ids, draft_probs, cu_draft, seeds, offsets):
    """The rule of reference/rejection_sampling.py in batched float64 ops: padded [B, K]
    acceptance tests, one residual / bonus row per request, one batched inverse-CDF draw."""
    target = target.double()
    cu = cu_draft.long()
    batch, vocab = cu.numel() - 1, target.shape[1]
    ks = cu[1:] - cu[:-1]
    width = int(ks.max()) if batch else 0
    j = torch.arange(width + 1)
    valid = j[None, :width] < ks[:, None]  # [B, K]
    pos = (offsets[:, None] + j[None, :]).long()  # [B, K + 1]
    zero = torch.zeros_like(pos)
    seed = seeds[:, None].long().expand_as(pos)
    w = philox4x32((pos, pos >> 32, zero, zero), (seed, seed >> 32))
    u_draw, u_accept = w[0].double() / 2**32, w[1].double() / 2**32
    draft_row = (cu[:-1, None] + j[None, :width]).clamp(max=max(len(draft_ids) - 1, 0))
    target_row = draft_row + torch.arange(batch)[:, None]
    x = draft_ids.long()[draft_row] if len(draft_ids) else torch.zeros_like(draft_row)
    px = target[target_row, x]
    qx = torch.ones_like(px) if draft_probs is None else draft_probs.double()[draft_row, x]
    accept = (u_accept[:, :width] * qx < px) & valid
    rejected = ~accept & valid
    first = ks.clone()  # accepted count
    if width:
        first = torch.where(rejected.any(1), rejected.double().argmax(1), ks)
    p = target[cu[:-1] + torch.arange(batch) + first]
    dist = p.clone()
    hit = first < ks
    hb = hit.nonzero().flatten()
    if len(hb):  # the residual of the rejected position
        fj = first[hb]
        if draft_probs is None:
            dist[hb, x[hb, fj]] = 0.0
        else:
            dist[hb] = (p[hb] - draft_probs.double()[cu[hb] + fj]).clamp(min=0.0)
    empty = hit & ~(dist.sum(1) > 0)
    dist[empty] = p[empty]
    cdf = dist.cumsum(1)
    u0 = u_draw.gather(1, first[:, None])
    token = torch.searchsorted(cdf, u0 * cdf[:, -1:], right=True)[:, 0].clamp(max=vocab - 1)
    out = torch.full((batch, width + 1), -1, dtype=torch.int32)
    out[:, :width] = torch.where(j[None, :width] < first[:, None], x, -1).int()
    out[torch.arange(batch), first] = token.int()
    return out, (first + 1).int()


def _normalised(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


def random_case(g, batch, vocab, max_k, point_mass, zeros=0.3):
    """Target and draft rows with zeros (truncated supports), proposals drawn from the draft
    (uniform over the vocabulary for point masses), k_b in [0, max_k]."""
    ks = torch.randint(0, max_k + 1, (batch,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), ks.cumsum(0)]).int()
    d = int(cu[-1])
    target = torch.rand(d + batch, vocab, generator=g) * (
        torch.rand(d + batch, vocab, generator=g) > zeros
    )
    target[:, 0] += 1e-3  # every row has mass
    target = _normalised(target.double())
    if point_mass:
        q = None
        ids = torch.randint(0, vocab, (d,), generator=g)
    else:
        q = _normalised(torch.rand(d, vocab, generator=g).double() ** 3 + 1e-6)
        ids = torch.multinomial(q, 1, generator=g)[:, 0] if d else torch.zeros(0, dtype=torch.long)
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    return target, ids.int(), q, cu, seeds, offsets


@pytest.mark.parametrize("point_mass", [True, False])
@pytest.mark.parametrize("vocab, max_k", [(7, 4), (50, 3), (1, 2)])
def test_reference_matches_the_independent_formulation(point_mass, vocab, max_k):
    g = torch.Generator().manual_seed(vocab * 10 + max_k + point_mass)
    case = random_case(g, 400, vocab, max_k, point_mass)
    target, ids, q, cu, seeds, offsets = case
    # degenerate rows: q = 2 p (p <= q everywhere: the residual is empty and the draw falls
    # back to p), an all-zero target row (every proposal rejected, the id V - 1)
    if q is not None:
        for b in range(0, 400, 7):
            for j in range(int(cu[b + 1] - cu[b])):
                q[int(cu[b]) + j] = 2 * target[int(cu[b]) + b + j]
    target[3] = 0.0
    expected = independent_rejection_sample(*case)
    got = reference.rejection_sample(*case)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    num = got[1]
    assert bool((num >= 1).all()) and bool((num <= cu[1:] - cu[:-1] + 1).all())


def test_outputs_layout_and_padding():
    g = torch.Generator().manual_seed(5)
    target, ids, q, cu, seeds, offsets = random_case(g, 50, 9, 5, False)
    tokens, num = reference.rejection_sample(target, ids, q, cu, seeds, offsets)
    ks = (cu[1:] - cu[:-1]).tolist()
    assert tokens.shape == (50, max(ks) + 1) and tokens.dtype == num.dtype == torch.int32
    for b, k in enumerate(ks):
        n = int(num[b])
        accepted = tokens[b, : n - 1].tolist()
        assert accepted == ids[int(cu[b]) : int(cu[b]) + n - 1].tolist()  # a prefix of the draft
        assert 0 <= int(tokens[b, n - 1]) < 9
        assert (tokens[b, n:] == -1).all()
        if n <= k:  # rejected at n - 1: drawn where the residual has mass (never x itself)
            residual = (target[int(cu[b]) + b + n - 1] - q[int(cu[b]) + n - 1]).clamp(min=0)
            assert residual[int(tokens[b, n - 1])] > 0
            assert residual[int(ids[int(cu[b]) + n - 1])] == 0


def _tv_bound(support: int, n: int) -> float:
    # P(TV >= eps) <= 2^K exp(-2 n eps^2) (Bretagnolle-Huber-Carol); eps at a 1e-9 false alarm.
    return math.sqrt((support * math.log(2) + math.log(1e9)) / (2 * n))


def _check_frequencies(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    freq = torch.bincount(tokens.long(), minlength=expected.numel()).double() / tokens.numel()
    assert (freq[expected == 0] == 0).all(), "a token outside the target's support"
    tv = 0.5 * float((freq - expected).abs().sum())
    assert tv < _tv_bound(int((expected > 0).sum()), tokens.numel()), tv


VOCAB = 12
K = 2
# target processing: (temperature, top_p, top_k)
TARGETS = {"t0.7 top-p 0.9": (0.7, 0.9, 0), "t0.7 top-k 5": (0.7, 1.0, 5), "t1.3": (1.3, 1.0, 0)}


def _synthetic_rows(seed: int, temperature: float, top_p: float, top_k: int):
    """K + 1 target rows (positions 0..K) from sampling_distribution over random logits, and K
    draft rows: a draft model's own, untruncated distribution over perturbed logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, VOCAB, generator=g) * 2
    target = reference.sampling_distribution(logits, temperature, top_p, top_k)
    noisy = logits[:K] + torch.randn(K, VOCAB, generator=g)
    draft = reference.sampling_distribution(noisy, 1.0, 1.0, 0)
    return target, draft


@pytest.mark.parametrize("draft_kind", ["point mass", "random draft"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_emitted_tokens_follow_the_target_distribution(draft_kind, name):
    # Every request sees the same target rows; proposals x_j ~ q_j (a fixed token for a point
    # mass). Token 0 ~ p_0; token 1, among requests that accepted proposal 0, ~ p_1; the bonus
    # token, among requests that accepted everything, ~ p_K.
    target, draft = _synthetic_rows(len(name), *TARGETS[name])
    g = torch.Generator().manual_seed(99)
    n = N_SEEDS
    if draft_kind == "point mass":
        probs = None
        ids = target[:K].argmax(1).repeat(n)  # a lookup that proposes the likeliest tokens
    else:
        probs = draft.repeat(n, 1)
        ids = torch.multinomial(probs, 1, generator=g)[:, 0]
    rows = target.float()
    target_rows = rows.repeat(n, 1)  # request b owns rows b (K + 1) .. b (K + 1) + K
    cu = (torch.arange(n + 1) * K).int()
    seeds = torch.arange(n, dtype=torch.int64) * 1000003 + 17
    offsets = torch.full((n,), 5, dtype=torch.int64)
    case = (target_rows, ids.int(), None if probs is None else probs.float(), cu, seeds, offsets)
    tokens, num = independent_rejection_sample(*case)
    m = 1024  # the reference itself, request for request, on the first m requests
    head = None if probs is None else probs[: m * K].float()
    sub = (target_rows[: m * (K + 1)], ids[: m * K].int(), head, cu[: m + 1], seeds[:m])
    ref = reference.rejection_sample(*sub, offsets[:m])
    assert torch.equal(ref[0], tokens[:m]) and torch.equal(ref[1], num[:m])

    p = rows.double()
    p = p / p.sum(-1, keepdim=True)
    _check_frequencies(tokens[:, 0], p[0])
    accepted = num >= 2
    assert int(accepted.sum()) > n // 20
    _check_frequencies(tokens[accepted, 1], p[1])
    bonus = num == K + 1
    assert int(bonus.sum()) > n // 100
    _check_frequencies(tokens[bonus, K], p[K])


def test_a_wrong_residual_is_caught_by_the_frequency_check():
    # The check has power: drawing the recovered token from p instead of max(0, p - q) (a
    # classic bug) moves token 0's distribution away from p_0 by far more than the bound.
    target, draft = _synthetic_rows(3, 0.7, 0.9, 0)
    g = torch.Generator().manual_seed(1)
    n = N_SEEDS
    ids = torch.multinomial(draft[0].expand(n, -1), 1, replacement=True, generator=g)[:, 0]
    u = torch.rand(n, generator=g, dtype=torch.float64)
    p0, q0 = target[0], draft[0]
    accept = u * q0[ids] < p0[ids]
    wrong = torch.where(accept, ids, torch.multinomial(p0.expand(n, -1), 1, generator=g)[:, 0])
    with pytest.raises(AssertionError):
        _check_frequencies(wrong, p0)


@pytest.mark.parametrize("point_mass", [True, False])
def test_greedy_accepts_exactly_the_argmax_prefix(point_mass):
    g = torch.Generator().manual_seed(8)
    batch, vocab, k = 64, 30, 4
    logits = torch.randn(batch * (k + 1), vocab, generator=g)
    target = reference.sampling_distribution(logits, 0.0, 1.0, 0)  # one-hot
    best = target.argmax(1).view(batch, k + 1)
    ids = best[:, :k].clone()
    cut = torch.randint(0, k + 1, (batch,), generator=g)  # proposals agree up to cut[b]
    for b in range(batch):
        if cut[b] < k:
            ids[b, cut[b]] = (best[b, cut[b]] + 1 + int(cut[b])) % vocab
    q = None if point_mass else _normalised(torch.rand(batch * k, vocab, generator=g).double())
    cu = (torch.arange(batch + 1) * k).int()
    seeds, offsets = torch.arange(batch) * 3 + 1, torch.zeros(batch, dtype=torch.int64)
    tokens, num = reference.rejection_sample(target, ids.flatten().int(), q, cu, seeds, offsets)
    assert num.tolist() == (cut + 1).tolist()
    for b in range(batch):
        c = int(cut[b])
        assert tokens[b, : c + 1].tolist() == best[b, : c + 1].tolist()


def test_no_proposals_is_sample():
    # k = 0 for every request: the bonus draw is exactly reference.sample's draw.
    g = torch.Generator().manual_seed(4)
    batch, vocab = 300, 40
    logits = torch.randn(batch, vocab, generator=g) * 2
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (0.8, 1.0, 5), (0.0, 1.0, 0)]:
        target = reference.sampling_distribution(logits, temperature, top_p, top_k)
        seeds = torch.arange(batch) * 7919 + 2**33
        offsets = torch.randint(0, 2**40, (batch,), generator=g)
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        empty = torch.zeros(0, dtype=torch.int32)
        tokens, num = reference.rejection_sample(target, empty, None, cu, seeds, offsets)
        expected = reference.sample(logits, temperature, top_p, top_k, seeds, offsets)
        assert (num == 1).all() and tokens[:, 0].tolist() == expected.tolist()


def test_draws_depend_only_on_seed_and_position():
    # A request alone gives what it gives inside a batch of others.
    g = torch.Generator().manual_seed(6)
    target, ids, q, cu, seeds, offsets = random_case(g, 20, 16, 3, False)
    full = reference.rejection_sample(target, ids, q, cu, seeds, offsets)
    for b in (0, 7, 19):
        rows = slice(int(cu[b]) + b, int(cu[b + 1]) + b + 1)
        drafts = slice(int(cu[b]), int(cu[b + 1]))
        one = reference.rejection_sample(
            target[rows], ids[drafts], q[drafts], torch.tensor([0, int(cu[b + 1] - cu[b])]).int(),
            seeds[b : b + 1], offsets[b : b + 1],
        )  # fmt: skip
        n = int(one[1][0])
        assert n == int(full[1][b]) and one[0][0, :n].tolist() == full[0][b, :n].tolist()


def test_draws_do_not_depend_on_k():
    # The same request with only its first k' proposals: where the longer run stopped within
    # them, the same tokens; otherwise k' accepted proposals and a bonus token from row k'.
    g = torch.Generator().manual_seed(12)
    batch, vocab, k = 200, 6, 4
    target, ids, q, cu, seeds, offsets = random_case(g, batch, vocab, k, False)
    cu = (torch.arange(batch + 1) * k).int()
    target = _normalised(torch.rand(batch * (k + 1), vocab, generator=g).double())
    q = _normalised(torch.rand(batch * k, vocab, generator=g).double())
    ids = torch.multinomial(q, 1, generator=g)[:, 0].int()
    full = reference.rejection_sample(target, ids, q, cu, seeds, offsets)
    short = 2
    keep_rows = torch.tensor([b * (k + 1) + j for b in range(batch) for j in range(short + 1)])
    keep_drafts = torch.tensor([b * k + j for b in range(batch) for j in range(short)])
    cu_short = (torch.arange(batch + 1) * short).int()
    part = reference.rejection_sample(
        target[keep_rows], ids[keep_drafts], q[keep_drafts], cu_short, seeds, offsets
    )
    stopped = full[1] <= short
    assert 0 < int(stopped.sum()) < batch
    assert torch.equal(part[1][stopped], full[1][stopped])
    assert torch.equal(part[0][stopped], full[0][stopped][:, : short + 1])
    assert (part[1][~stopped] == short + 1).all()
    assert torch.equal(part[0][~stopped, :short], full[0][~stopped, :short])


# ---- ops.rejection_sample: the boundary ---------------------------------------------------------


def _args(batch=3, vocab=10, k=2):
    g = torch.Generator().manual_seed(0)
    return dict(
        target_probs=_normalised(torch.rand(batch * (k + 1), vocab, generator=g)),
        draft_token_ids=torch.zeros(batch * k, dtype=torch.int32),
        draft_probs=torch.full((batch * k, vocab), 1.0 / vocab),
        cu_draft=(torch.arange(batch + 1) * k).int(),
        seeds=torch.arange(batch, dtype=torch.int64),
        offsets=torch.zeros(batch, dtype=torch.int64),
    )


def test_op_runs_the_reference_on_cpu_and_fills_given_outputs():
    args = _args()
    tokens, num = ops.rejection_sample(**args)
    ref = reference.rejection_sample(*args.values())
    assert torch.equal(tokens, ref[0]) and torch.equal(num, ref[1])
    out = torch.full((3, 5), -7, dtype=torch.int32)  # wider than max k + 1: padded with -1
    out_num = torch.full((3,), -7, dtype=torch.int32)
    result = ops.rejection_sample(**args, out_token_ids=out, out_num_tokens=out_num)
    assert result[0] is out and result[1] is out_num
    assert torch.equal(out[:, :3], ref[0]) and (out[:, 3:] == -1).all()
    assert torch.equal(out_num, ref[1])


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(draft_token_ids=torch.zeros(6, dtype=torch.int64)), TypeError,
         "draft_token_ids .*int32"),
        (dict(target_probs=torch.rand(8, 10)), ValueError, "must have D \\+ B = 6 \\+ 3 = 9 rows"),
        (dict(target_probs=torch.rand(9, 10).half()), TypeError, "target_probs .*float16"),
        (dict(target_probs=torch.rand(10, 9).t()), ValueError, "rows must be contiguous"),
        (dict(target_probs=torch.rand(9, 0)), ValueError, "vocabulary is empty"),
        (dict(draft_probs=torch.rand(6, 11)), ValueError, "draft_probs .*shape \\(6, 10\\)"),
        (dict(draft_probs=torch.rand(6, 10).double()), TypeError, "draft_probs .*float32"),
        (dict(seeds=torch.zeros(3, dtype=torch.int32)), TypeError, "seeds .*int64"),
        (dict(offsets=torch.zeros(4, dtype=torch.int64)), ValueError, "offsets .*shape \\(3,\\)"),
        (dict(cu_draft=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_draft .*B \\+ 1 >= 1"),
        (dict(cu_draft=torch.tensor([0, 4, 2, 6]).int()), ValueError, "must not decrease"),
        (dict(cu_draft=torch.tensor([1, 2, 4, 6]).int()), ValueError, "cu_draft\\[0\\] = 1"),
        (dict(draft_token_ids=torch.tensor([0, 1, 10, 0, 0, 0]).int()), ValueError,
         "draft_token_ids\\[2\\] = 10 is outside the vocabulary"),
        (dict(draft_token_ids=torch.tensor([0, 1, -1, 0, 0, 0]).int()), ValueError,
         "draft_token_ids\\[2\\] = -1"),
        (dict(out_token_ids=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "together"),
        (dict(out_token_ids=torch.zeros(3, 2, dtype=torch.int32),
              out_num_tokens=torch.zeros(3, dtype=torch.int32)), ValueError,
         "needs 3 columns, has 2"),
        (dict(out_token_ids=torch.zeros(3, 3, dtype=torch.int64),
              out_num_tokens=torch.zeros(3, dtype=torch.int32)), TypeError,
         "out_token_ids .*int32"),
        (dict(seeds=[1, 2, 3]), TypeError, "seeds must be a torch tensor"),
    ],
)  # fmt: skip
def test_bad_arguments_are_clear_errors(change, error, match):
    args = {**_args(), **change}
    with pytest.raises(error, match=match):
        ops.rejection_sample(**args)
