"""The decode kernels' algorithms on the CPU, without a GPU: the split-KV plan and partitioning
(pagedkern.ops.paged_attention is the host code itself), the merge of split partials, a Python
mirror of csrc/paged_attention.cu's index math for every dispatched configuration, and a torch
mirror of csrc/sampling.cu's sampler (radix descent over order keys with fixed-point masses, then
an inverse-CDF draw) checked to give exactly the distribution of pagedkern.reference.sample.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkern.ops.paged_attention import (
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    MMA_HEADS,
    SPLIT_ALIGN,
    SplitPlan,
    ctas_per_kv_head,
    plan_splits,
    split_bounds,
    workspace_size,
)
from pagedkern.reference import merge_attention_states, paged_attention, sample
from pagedkern.reference.sampling import uniform

H200_SMS = 132

# ---------------------------------------------------------------------------------------------
# Split-KV plan and partition


@pytest.mark.parametrize("batch", [1, 3, 8, 64, 129])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (9, 3), (64, 8), (16, 16)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("max_len", [1, 63, 64, 255, 256, 1000, 4097, 16384, 131072])
def test_split_plan_is_well_formed(batch, heads, head_dim, max_len):
    hq, hkv = heads
    plan = plan_splits(batch, hq, hkv, head_dim, max_len, H200_SMS)
    assert 1 <= plan.num_splits <= MAX_SPLITS
    if plan.num_splits == 1:
        assert plan.split_size == 0
        return
    size, n = plan.split_size, plan.num_splits
    assert size % SPLIT_ALIGN == 0 and size >= MIN_SPLIT_TOKENS
    assert (n - 1) * size < max_len <= n * size, "no empty split at max_seq_len"
    ctas = batch * hkv * ctas_per_kv_head(hq // hkv, head_dim)
    assert ctas < 4 * H200_SMS, "a full GPU is never split"
    assert workspace_size(batch, hq, head_dim, n) == batch * hq * n * (head_dim + 1)


def test_split_plan_for_the_benchmark_cases():
    # B=64, L=4096, 32/8 heads: 512 CTAs already fill 132 SMs x 4.
    assert plan_splits(64, 32, 8, 128, 4096, H200_SMS) == SplitPlan(1, 0)
    # B=1, L=32768: 8 CTAs; 64 splits of 512 tokens make 512 CTAs, one wave.
    assert plan_splits(1, 32, 8, 128, 32768, H200_SMS) == SplitPlan(64, 512)
    # Explicit counts are honoured (rounded to whole 64-token tiles).
    assert plan_splits(64, 32, 8, 128, 4096, H200_SMS, num_splits=4) == SplitPlan(4, 1024)
    assert plan_splits(1, 32, 8, 128, 1000, H200_SMS, num_splits=3) == SplitPlan(3, 384)
    assert plan_splits(1, 32, 8, 128, 100, H200_SMS, num_splits=5) == SplitPlan(2, 64)
    assert plan_splits(1, 32, 8, 128, 64, H200_SMS, num_splits=5) == SplitPlan(1, 0)


def test_split_plan_prefers_fewer_splits_and_fills_the_gpu():
    for batch in (1, 2, 4, 8, 16, 32):
        plan = plan_splits(batch, 32, 8, 128, 32768, H200_SMS)
        ctas = batch * 8 * plan.num_splits
        assert ctas <= 4 * H200_SMS, "at most one wave"
        assert ctas > 2 * H200_SMS, "more than half a wave"


@pytest.mark.parametrize("plan", [SplitPlan(1, 0), SplitPlan(3, 384), SplitPlan(64, 512)])
def test_split_bounds_partition_every_length(plan):
    limit = 3 * 64 * 512
    for length in [*range(0, 1200), 4097, 16384, 32768, 32769, 40000, limit]:
        bounds = split_bounds(plan, length)
        if length == 0:
            assert bounds == []
            continue
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(a < b for a, b in bounds), "no empty split is launched"
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:])), "contiguous"
        assert len(bounds) <= plan.num_splits
        if plan.num_splits > 1:
            # The merge kernel's count of splits holding keys.
            assert len(bounds) == min(plan.num_splits, math.ceil(length / plan.split_size))
            assert all(a == s * plan.split_size for s, (a, _) in enumerate(bounds))


def _paged(seq_lens, hkv, block_size, head_dim, g):
    """Float64 caches with shuffled pages, NaN everywhere outside the sequences."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 1, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(needed)), order[-1], dtype=torch.int32)
    k_cache = torch.full((len(order), hkv, block_size, head_dim), math.nan, dtype=torch.float64)
    v_cache = k_cache.clone()
    for b, n in enumerate(seq_lens):
        pages, order = order[: needed[b]], order[needed[b] :]
        tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for t in range(n):
            k_cache[pages[t // block_size], :, t % block_size] = torch.randn(hkv, head_dim)
            v_cache[pages[t // block_size], :, t % block_size] = torch.randn(hkv, head_dim)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_merging_the_planned_splits_equals_unsplit_attention(block_size):
    # Each split as the kernel cuts it (64-token multiples: whole pages), attended separately
    # through a shifted block table, then merged: equal to attention over the whole sequence.
    g = torch.Generator().manual_seed(block_size)
    torch.manual_seed(block_size)
    seq_lens = [1, 15, 16, 17, 255, 1000, 1300]
    hq, hkv, d = 8, 2, 64
    k_cache, v_cache, tables = _paged(seq_lens, hkv, block_size, d, g)
    q = torch.randn(len(seq_lens), hq, d, generator=g, dtype=torch.float64)
    plan = plan_splits(1, hq, hkv, d, 1024, H200_SMS, num_splits=4)  # last split runs past 1024
    assert plan == SplitPlan(4, 256)
    full, full_lse = paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens), return_lse=True
    )
    for b, n in enumerate(seq_lens):
        outs, lses = [], []
        for start, end in split_bounds(plan, n):
            table = tables[b : b + 1].roll(-(start // block_size), dims=1)
            o, lse = paged_attention(
                q[b : b + 1], k_cache, v_cache, table, torch.tensor([end - start]), return_lse=True
            )
            outs.append(o.float())  # the kernel keeps partials in fp32
            lses.append(lse)
        out, lse = merge_attention_states(outs, lses)
        torch.testing.assert_close(out.double(), full[b : b + 1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse.double(), full_lse[b : b + 1].double(), rtol=1e-6, atol=1e-6)
        # The merge kernel's formula: weights exp(lse_s - max), then one division.
        lse_s = torch.stack(lses)
        w = torch.exp(lse_s - lse_s.max(0).values)
        mine = (w[..., None] * torch.stack(outs)).sum(0) / w.sum(0)[..., None]
        torch.testing.assert_close(mine.double(), full[b : b + 1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Index math of csrc/paged_attention.cu, mirrored


def _shape(d):
    lanes, rows = d // 8, 16 if d == 64 else 8
    return lanes, rows, 4096 // d  # lanes, rows, tile tokens


def _layout(group, d):
    """(heads per unit, head_chunks, units_per_cta) as launch<T, D>() computes them."""
    heads = 2 if group % 2 == 0 else 1
    units = group // heads
    chunks = math.ceil(units / _shape(d)[1])
    return heads, chunks, math.ceil(units / chunks)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_query_head_is_computed_once(d):
    lanes, rows, _ = _shape(d)
    for group in range(1, 65):
        heads, chunks, per_cta = _layout(group, d)
        assert chunks == ctas_per_kv_head(group, d)
        written = []
        for chunk in range(chunks):
            first = chunk * per_cta
            units = min(per_cta, group // heads - first)
            assert 1 <= units <= rows
            zs = rows // units
            for row in range(rows):
                g, z = divmod(row, zs)
                if g < units and z == 0:  # the row that stores a head unit
                    written += [(first + g) * heads + h for h in range(heads)]
        assert sorted(written) == list(range(group)), f"group {group}"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_token_slots_cover_each_tile_once_per_head_unit(d):
    lanes, rows, tile = _shape(d)
    for units in range(1, rows + 1):
        zs = rows // units
        for valid in range(1, tile + 1):
            seen = []
            base = 0
            while base < valid:  # the group loop, identical trip count for every thread
                for z in range(zs):
                    for u in range(4):
                        j = base + z + u * zs
                        assert j < 3 * tile + 4 * rows, "stale read would leave the K/V ring"
                        if u * zs < valid - base - z:
                            seen.append(j)
                base += 4 * zs
            assert sorted(seen) == list(range(valid))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_copy_mapping_and_page_offsets(d, block_size):
    lanes, rows, tile = _shape(d)
    per_thread = tile // rows
    chunks = sorted(
        (row + i * rows, lane)
        for row in range(rows)
        for lane in range(lanes)
        for i in range(per_thread)
    )
    assert chunks == [(j, x) for j in range(tile) for x in range(lanes)], "each 16 B once"
    # Flat element offset of token t's chunk in page `page`, KV head h, as the kernel computes it.
    hkv, pages = 3, 5
    cache = torch.arange(pages * hkv * block_size * d).view(pages, hkv, block_size, d)
    shift = block_size.bit_length() - 1
    for page, h, t, lane in [(0, 0, 0, 0), (4, 2, 1000, lanes - 1), (3, 1, 37, 2)]:
        offset = ((page * hkv + h) * block_size + (t & (block_size - 1))) * d + lane * 8
        assert int(cache[page, h, t % block_size, lane * 8]) == offset
        assert t >> shift == t // block_size


# ---------------------------------------------------------------------------------------------
# The sampler of csrc/sampling.cu, mirrored in torch

MASS_SCALE = 2**40


def _keys(s: torch.Tensor) -> torch.Tensor:
    """Order-preserving 32-bit keys of float32 values (as int64)."""
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def _descend(keys, masses, floor, k=None, top_p=None):
    """Radix descent, 8 bits per pass: (threshold, kept mass). Count mode (k): the bin of the
    k-th largest key; mass mode (top_p): the lowest non-empty bin whose mass above is < p * Z
    or 0."""
    prefix, bits, above_c, above_m, pz = 0, 0, 0, 0, None
    while True:
        cand = keys >= floor
        if bits:
            cand &= ((keys ^ prefix) >> (32 - bits)) == 0
        bins = (keys[cand] >> (24 - bits)) & 255
        count = torch.bincount(bins, minlength=256).tolist()
        mass = torch.zeros(256, dtype=torch.int64).index_add_(0, bins, masses[cand]).tolist()
        if pz is None:
            pz = float(top_p or 0.0) * float(sum(mass))
        c, m, chosen = above_c, above_m, None
        for b in range(255, -1, -1):
            take = (
                count[b] > 0 and (float(m) < pz or m == 0)
                if top_p is not None
                else c < k <= c + count[b]
            )
            if take:
                chosen = (b, c, m)
            c, m = c + count[b], m + mass[b]
        b, above_c, above_m = chosen
        prefix |= b << (24 - bits)
        bits += 8
        done = count[b] == 1 if top_p is not None else above_c + count[b] == k
        if bits == 32 or done:
            return prefix, above_m + mass[b]


def mirror_sample(row, temperature, top_p, top_k, seed, offset):
    """(token id, kept fixed-point masses) for one logits row, as csrc/sampling.cu computes them."""
    x = row.float().clone()
    x[x.isnan()] = -math.inf
    greedy = int(x.argmax())
    if not temperature > 0 or x.max() == -math.inf:
        return greedy, None
    if (x == math.inf).any():
        x = torch.where(x == math.inf, 0.0, -math.inf)
    s = x / torch.tensor(temperature, dtype=torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0 -> +0
    s = torch.where(s.isnan(), -math.inf, s)  # -inf / inf (temperature = inf)
    s_max = s.max()
    if s_max == math.inf:
        return greedy, None
    keys = _keys(s)
    masses = (torch.exp(s - s_max) * MASS_SCALE).to(torch.int64)
    masses[s == -math.inf] = 0
    vocab = x.numel()
    k = top_k if 0 < top_k < vocab else vocab
    use_p = top_p < 1
    tau, z = 0, None
    if k < vocab or not use_p:
        tau, z = _descend(keys, masses, 0, k=k)
    if use_p:
        tau_p, z = _descend(keys, masses, tau, top_p=float(torch.tensor(top_p).float()))
        tau = max(tau, tau_p)
    kept = torch.where(keys >= tau, masses, 0)
    assert int(kept.sum()) == z, "the descent's kept mass is the mass of {key >= tau}"
    word = int(uniform(torch.tensor([seed]), torch.tensor([offset]))[0] * 2**32)
    target = (z * word) >> 32
    return int((kept.cumsum(0) > target).nonzero()[0]), kept


def _expected(row, temperature, top_p, top_k):
    """The reference semantics restated in float64: None for greedy rows, else probabilities."""
    x = row.double().clone()
    x[x.isnan()] = -math.inf
    if temperature <= 0 or not (x > -math.inf).any():
        return None
    if (x == math.inf).any():
        return (x == math.inf).double() / (x == math.inf).sum()
    s = (row.float() / temperature).double()  # the fp32 division decides ties, as everywhere
    s[row.isnan()] = -math.inf
    if s.max() == math.inf:
        return None
    if 0 < top_k < x.numel():
        s[s < s.sort(descending=True).values[top_k - 1]] = -math.inf
    p = torch.exp(s - s.max())
    p /= p.sum()
    if top_p < 1:
        above = torch.stack([p[p > pi].sum() for pi in p])
        p[(above >= top_p) & (above > 0)] = 0
        p /= p.sum()
    return p


def _rows(g):
    """Logits rows with ties, NaN, +inf, -inf and -0.0 entries."""
    v = 97
    plain = torch.randn(v, generator=g) * 2
    ties = (torch.randn(v, generator=g) * 2).round()  # many exact ties, and -0.0
    ties[ties == 0] = -0.0
    nan = torch.randn(v, generator=g)
    nan[::7] = math.nan
    neg = torch.randn(v, generator=g)
    neg[:50] = -math.inf
    posinf = torch.randn(v, generator=g)
    posinf[[3, 40, 41]] = math.inf
    flat = torch.randn(v, generator=g) * 0.01
    return {"plain": plain, "ties": ties, "nan": nan, "neg": neg, "posinf": posinf, "flat": flat}


PARAMS = [
    (1.0, 1.0, 0),
    (0.7, 1.0, 10),
    (1.3, 0.8, -1),
    (1.0, 0.6, 20),
    (1.0, 1.0, 5),
    (0.5, 0.5, 0),
    (2.0, 0.95, 50),
    (1.0, 0.0, 0),  # top_p <= 0: the top tie group only
    (1.0, 0.9, 96),
    (1.0, 0.9, 200),  # k >= vocab: off
    (0.0, 0.9, 5),  # greedy
    (1e-30, 0.9, 0),  # s overflows: greedy
]


@pytest.mark.parametrize("name", ["plain", "ties", "nan", "neg", "posinf", "flat"])
def test_mirrored_sampler_has_exactly_the_reference_distribution(name):
    g = torch.Generator().manual_seed(11)
    row = _rows(g)[name]
    for temperature, top_p, top_k in PARAMS:
        expected = _expected(row, temperature, top_p, top_k)
        token, kept = mirror_sample(row, temperature, top_p, top_k, 5, 7)
        if expected is None or kept is None:
            assert kept is None and expected is None, (temperature, top_p, top_k)
            assert token == int(sample(row[None], temperature, top_p, top_k, 5, 7)[0])
            continue
        probs = kept.double() / kept.sum()
        assert torch.equal(probs > 0, expected > 0), f"kept set differs {temperature, top_p, top_k}"
        torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-9)
        assert expected[token] > 0


@pytest.mark.parametrize("name", ["plain", "ties", "nan", "posinf"])
def test_mirrored_sampler_draws_the_reference_ids(name):
    # Same u (Philox word 0 of (seed, offset)) and the same inverse CDF in vocabulary order: the
    # ids agree with the reference's draw for draw, up to cumulative sums rounding differently
    # at a boundary (fp64 of fp32 probabilities vs exact fixed point), which these seeds avoid.
    g = torch.Generator().manual_seed(12)
    row = _rows(g)[name]
    seeds = torch.arange(300) * 7919 + 2**33
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.8, 0.9, 0), (1.2, 0.7, 30), (1.0, 1.0, 7)]:
        ref = sample(row.expand(300, -1), temperature, top_p, top_k, seeds, 3)
        mine = [mirror_sample(row, temperature, top_p, top_k, int(s), 3)[0] for s in seeds]
        assert ref.tolist() == mine


def test_descent_passes_and_early_exit():
    # Count mode stops as soon as the bin holding the k-th key is taken whole.
    keys = _keys(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    masses = torch.ones(4, dtype=torch.int64)
    tau, z = _descend(keys, masses, 0, k=2)
    assert z == 2 and int((keys >= tau).sum()) == 2
    tau, z = _descend(keys, masses, 0, k=4)
    assert z == 4 and bool((keys >= tau).all())
    # Ties at the k-th key are all kept.
    keys = _keys(torch.tensor([5.0, 2.0, 2.0, 2.0, 1.0]))
    tau, z = _descend(keys, torch.ones(5, dtype=torch.int64), 0, k=2)
    assert z == 4


# ---------------------------------------------------------------------------------------------
# csrc/paged_attention_mma.cuh's index math: head chunks, and ldmatrix rows in the swizzled ring


def test_mma_kernel_computes_every_query_head_once():
    for group in range(1, 65):
        chunks = math.ceil(group / MMA_HEADS)  # layout_for()
        assert chunks == ctas_per_kv_head(group, 128, "mma")
        covered = []
        for chunk in range(chunks):  # the kernel: first = chunk * 8, heads = min(8, group - first)
            first = chunk * MMA_HEADS
            heads = min(MMA_HEADS, group - first)
            assert 1 <= heads <= MMA_HEADS
            covered += [first + g for g in range(heads)]  # lanes g < heads hold real heads
        assert covered == list(range(group))


def _swizzled(token: int, chunk: int, d: int) -> int:
    return token * d + ((chunk ^ (token & 7)) << 3)  # swizzled<D>() in elements


@pytest.mark.parametrize("d", [64, 128])
def test_mma_ldmatrix_rows_hit_distinct_banks(d):
    # Each 8x8 matrix of an ldmatrix reads 8 rows of 16 bytes: conflict-free when they fall in
    # the 8 distinct 16-byte bank groups of a 128-byte line. Lane l gives row l % 8 of matrix
    # l / 8: K as A (tokens + 8 (mat % 2), chunk mat / 2), V^T as A (tokens + 8 (mat / 2), chunk
    # mat % 2), as the kernel computes k_token / v_token; every warp and k-step.
    for warp in range(4096 // d // 16):
        for step in range(d // 16):
            for mat in range(4):
                k_rows = [16 * warp + r + 8 * (mat % 2) for r in range(8)]
                v_rows = [16 * warp + r + 8 * (mat // 2) for r in range(8)]
                for tokens, chunk in ((k_rows, 2 * step + mat // 2), (v_rows, 2 * step + mat % 2)):
                    rows = [_swizzled(t, chunk, d) * 2 for t in tokens]
                    assert all(a % 16 == 0 for a in rows)
                    assert len({(a // 16) % 8 for a in rows}) == 8, (warp, step, mat, rows)
                    # the unswizzled layout would conflict 8 ways (why the XOR is there)
                    assert len({(t * d + chunk * 8) * 2 // 16 % 8 for t in tokens}) == 1
