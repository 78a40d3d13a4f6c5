"""The reference paged_attention, flash_prefill and merge_attention_states against dense float64.

Each sequence's keys and values are generated dense ([L, Hkv, D]) and scattered into the paged
cache through a shuffled, non-contiguous block table; every other cache slot (unused blocks and the
tail of each last block) holds NaN, so reading a wrong page or past seq_len shows up as NaN.
The expected results are textbook softmax attention in float64 over the dense keys.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkern.reference import flash_prefill, merge_attention_states, paged_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (Hq, Hkv): GQA ratios 1, 3, 4, 8 and MQA.
HEADS = [(4, 4), (6, 2), (8, 2), (16, 2), (8, 1)]
D = 64


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _paged_cache(seq_lens, hkv, block_size, dtype, g, spare_blocks=3):
    """Dense per-sequence K/V lists and the NaN-poisoned paged caches + int32 block tables."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()  # shuffled physical pages
    spare = order[sum(needed) :]
    width = max(max(needed), 1)
    # Unused table entries point at a poisoned spare page: reading them would give NaN.
    tables = torch.full((len(seq_lens), width), spare[0], dtype=torch.int32)
    k_cache = torch.full((num_blocks, hkv, block_size, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        pages, order = order[: needed[b]], order[needed[b] :]
        tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k, v = _randn((n, hkv, D), dtype, g), _randn((n, hkv, D), dtype, g)
        for t in range(n):
            page, offset = pages[t // block_size], t % block_size
            k_cache[page, :, offset], v_cache[page, :, offset] = k[t], v[t]
        keys.append(k)
        values.append(v)
    return keys, values, k_cache, v_cache, tables


def _attention64(q, k, v, scale, first_pos=None):
    """q [Tq, Hq, D], k/v [L, Hkv, D] -> (out, lse) in float64. Causal when first_pos is given:
    query i sits at position first_pos + i and sees keys 0..first_pos + i."""
    tq, hq, _ = q.shape
    length, hkv, _ = k.shape
    out = torch.zeros(tq, hq, D, dtype=torch.float64)
    lse = torch.full((tq, hq), -math.inf, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)  # query head h reads KV head h // (Hq / Hkv)
        scores = (q[:, h].double() @ k[:, kv].double().T) * scale  # [Tq, L]
        if first_pos is not None:
            visible = torch.arange(length)[None, :] <= (first_pos + torch.arange(tq))[:, None]
            scores = scores.masked_fill(~visible, -math.inf)
        m = scores.max(-1, keepdim=True).values
        weights = torch.exp(scores - m)
        denom = weights.sum(-1, keepdim=True)
        out[:, h] = (weights / denom) @ v[:, kv].double()
        lse[:, h] = (m + denom.log())[:, 0]
    return out, lse


def _check(out, lse, out64, lse64, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    # fp32 math, rounded once to the output dtype (half an ulp for fp16/bf16).
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    torch.testing.assert_close(out.double(), out64, rtol=rtol * 1.01, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_dense(dtype, hq, hkv, block_size):
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + block_size)
    seq_lens = [1, 15, 0, 16, 17, 100, 33]  # 0 = padding row
    keys, values, k_cache, v_cache, tables = _paged_cache(seq_lens, hkv, block_size, dtype, g)
    q = _randn((len(seq_lens), hq, D), dtype, g)
    out, lse = paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), return_lse=True
    )
    assert out.shape == (len(seq_lens), hq, D) and lse.shape == (len(seq_lens), hq)
    for b, n in enumerate(seq_lens):
        if n == 0:  # padding: zeros and lse -inf
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            assert torch.isneginf(lse[b]).all()
            continue
        out64, lse64 = _attention64(q[b : b + 1], keys[b], values[b], D**-0.5)
        _check(out[b : b + 1], lse[b : b + 1], out64, lse64, dtype)


def test_paged_attention_scale_and_out():
    g = torch.Generator().manual_seed(1)
    seq_lens = [40, 7]
    keys, values, k_cache, v_cache, tables = _paged_cache(seq_lens, 2, 16, torch.float32, g)
    q = _randn((2, 4, D), torch.float32, g)
    out = torch.full((2, 4, D), float("nan"))  # poisoned
    result = paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens), scale=0.3, out=out
    )
    assert result is out
    for b in range(2):
        out64, _ = _attention64(q[b : b + 1], keys[b], values[b], 0.3)
        torch.testing.assert_close(out[b : b + 1].double(), out64, rtol=1e-5, atol=1e-5)


PREFIXES = [0, 15, 16, 40]
CHUNKS = [1, 7, 33]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_flash_prefill_matches_dense_causal(dtype, hq, hkv, block_size):
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + block_size + 1)
    # One varlen batch: every (cached prefix, chunk) pair, plus a sequence with an empty chunk.
    pairs = [(p, c) for p in PREFIXES for c in CHUNKS] + [(20, 0)]
    perm = torch.randperm(len(pairs), generator=g).tolist()
    pairs = [pairs[i] for i in perm]
    seq_lens = [p + c for p, c in pairs]
    keys, values, k_cache, v_cache, tables = _paged_cache(seq_lens, hkv, block_size, dtype, g)
    cu = torch.tensor([0] + [c for _, c in pairs], dtype=torch.int32).cumsum(0).int()
    q = _randn((int(cu[-1]), hq, D), dtype, g)
    out, lse = flash_prefill(
        q, k_cache, v_cache, cu, tables, torch.tensor(seq_lens, dtype=torch.int32), return_lse=True
    )
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    for b, (prefix, chunk) in enumerate(pairs):
        if chunk == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        out64, lse64 = _attention64(q[rows], keys[b], values[b], D**-0.5, first_pos=prefix)
        _check(out[rows], lse[rows], out64, lse64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (8, 1)])
def test_flash_prefill_sequence_alone_equals_it_in_a_batch(dtype, hq, hkv):
    # The reference batches sequences of as many key blocks into padded GEMMs; a sequence's
    # rows must come out bit for bit as when it is prefilled alone, so greedy outputs do not
    # depend on what else a step carries (one-token MHA chunks included: a one-row GEMM
    # rounds apart).
    g = torch.Generator().manual_seed(hq * 10 + hkv + 7)
    pairs = [(p, c) for p in [0, 3, 15, 16, 40] for c in [1, 2, 5, 12, 33]] + [(20, 0)]
    perm = torch.randperm(len(pairs), generator=g).tolist()
    pairs = [pairs[i] for i in perm]
    seq_lens = torch.tensor([p + c for p, c in pairs], dtype=torch.int32)
    _, _, k_cache, v_cache, tables = _paged_cache(seq_lens.tolist(), hkv, 16, dtype, g)
    cu = torch.tensor([0] + [c for _, c in pairs]).cumsum(0).int()
    q = _randn((int(cu[-1]), hq, D), dtype, g)
    out, lse = flash_prefill(q, k_cache, v_cache, cu, tables, seq_lens, return_lse=True)
    assert not out.isnan().any() and not lse[lse != float("-inf")].isnan().any()
    for b, (_, chunk) in enumerate(pairs):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone, alone_lse = flash_prefill(
            q[rows], k_cache, v_cache, torch.tensor([0, chunk]).int(), tables[b : b + 1],
            seq_lens[b : b + 1], return_lse=True,
        )  # fmt: skip
        assert torch.equal(alone, out[rows]) and torch.equal(alone_lse, lse[rows]), (b, pairs[b])


def test_flash_prefill_rejects_chunk_longer_than_sequence():
    g = torch.Generator().manual_seed(2)
    _, _, k_cache, v_cache, tables = _paged_cache([5], 1, 16, torch.float32, g)
    q = _randn((6, 2, D), torch.float32, g)
    with pytest.raises(ValueError):
        flash_prefill(q, k_cache, v_cache, torch.tensor([0, 6]), tables, torch.tensor([5]))


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (9, 3)])
def test_flash_prefill_single_token_chunks_equal_decode(hq, hkv):
    # A chunk of one token at position seq_len - 1 is exactly a decode step, bit for bit (a
    # prompt's last token chunked alone, or a generated token recomputed after preemption,
    # must not change the logits: see MIN_GEMM_ROWS), and so is the last row of a longer chunk.
    g = torch.Generator().manual_seed(3)
    seq_lens = torch.tensor([1, 15, 16, 17, 100], dtype=torch.int32)
    _, _, k_cache, v_cache, tables = _paged_cache(seq_lens.tolist(), hkv, 16, torch.float32, g)
    q = _randn((5, hq, D), torch.float32, g)
    cu = torch.arange(6, dtype=torch.int32)
    out_p, lse_p = flash_prefill(q, k_cache, v_cache, cu, tables, seq_lens, return_lse=True)
    out_d, lse_d = paged_attention(q, k_cache, v_cache, tables, seq_lens, return_lse=True)
    assert not out_p.isnan().any()
    assert torch.equal(out_p, out_d)
    torch.testing.assert_close(lse_p, lse_d, rtol=1e-6, atol=1e-6)
    for b, n in enumerate(seq_lens.tolist()):  # the whole sequence as one chunk: its last row
        rows = _randn((n, hq, D), torch.float32, g)
        rows[-1] = q[b]
        whole = flash_prefill(rows, k_cache, v_cache, torch.tensor([0, n]).int(), tables[b : b + 1],
                              seq_lens[b : b + 1])  # fmt: skip
        assert torch.equal(whole[-1], out_d[b]), b


def _split_points(length, n_splits, g, multiple=1):
    """Sorted cut points 0 = c0 <= c1 <= ... <= cn = length; repeats make empty splits."""
    inner = torch.randint(0, length // multiple + 1, (n_splits - 1,), generator=g) * multiple
    return [0, *sorted(inner.tolist()), length]


@pytest.mark.parametrize("block_size", [16, 32])
def test_split_kv_with_paged_attention_merges_to_unsplit(block_size):
    # Split-KV as a kernel does it: each split is paged attention over a page-aligned key range
    # (a shifted block table), and the partial (out, lse) pairs are merged.
    g = torch.Generator().manual_seed(4 + block_size)
    hq, hkv, n_splits = 8, 2, 4
    seq_lens = [1, 16, 17, 100, 250]
    keys, values, k_cache, v_cache, tables = _paged_cache(
        seq_lens, hkv, block_size, torch.float32, g
    )
    q = _randn((len(seq_lens), hq, D), torch.float32, g)
    cuts = [_split_points(n, n_splits, g, multiple=block_size) for n in seq_lens]
    assert any(c[i] == c[i + 1] for c in cuts for i in range(n_splits)), "want an empty split"
    outs, lses = [], []
    for s in range(n_splits):
        lens = torch.tensor([c[s + 1] - c[s] for c in cuts], dtype=torch.int32)
        shifted = torch.stack([tables[b].roll(-(c[s] // block_size)) for b, c in enumerate(cuts)])
        o, lse = paged_attention(q, k_cache, v_cache, shifted, lens, return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = merge_attention_states(outs, lses)
    for b in range(len(seq_lens)):
        out64, lse64 = _attention64(q[b : b + 1], keys[b], values[b], D**-0.5)
        _check(out[b : b + 1], lse[b : b + 1], out64, lse64, torch.float32)


@pytest.mark.parametrize("n_splits", [1, 2, 5, 9])
def test_merge_of_float64_partials_equals_unsplit(n_splits):
    # Arbitrary (not page-aligned) cut points; partials from our own float64 code, stored as
    # fp32 like a kernel's scratch. Leading dims [B, Hq] as in split-KV decode.
    g = torch.Generator().manual_seed(10 + n_splits)
    hq, hkv, length = 4, 2, 77
    q = _randn((1, hq, D), torch.float32, g)
    k, v = _randn((length, hkv, D), torch.float32, g), _randn((length, hkv, D), torch.float32, g)
    cuts = _split_points(length, n_splits, g)
    cuts[1:1] = [cuts[1]] if n_splits > 1 else []  # force at least one empty split
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:  # empty key set: zero output, lse -inf
            outs.append(torch.zeros(1, hq, D))
            lses.append(torch.full((1, hq), -math.inf))
            continue
        o, lse = _attention64(q, k[a:b], v[a:b], D**-0.5)
        outs.append(o.float())
        lses.append(lse.float())
    out, lse = merge_attention_states(outs, lses)
    out64, lse64 = _attention64(q, k, v, D**-0.5)
    _check(out, lse, out64, lse64, torch.float32)
    # The merge is symmetric in its inputs.
    out_r, lse_r = merge_attention_states(outs[::-1], lses[::-1])
    torch.testing.assert_close(out_r, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_r, lse, rtol=1e-6, atol=1e-6)


def test_merge_of_only_empty_splits_is_zero():
    out, lse = merge_attention_states(
        [torch.zeros(3, 2, D), torch.zeros(3, 2, D)], [torch.full((3, 2), -math.inf)] * 2
    )
    assert torch.equal(out, torch.zeros(3, 2, D)), "no NaN from -inf - -inf"
    assert torch.isneginf(lse).all()
