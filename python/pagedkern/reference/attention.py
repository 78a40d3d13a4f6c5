"""Attention over the paged KV cache: decode (one query per sequence) and causal varlen prefill.

Cache pages are [num_blocks, Hkv, block_size, D] (HND); a sequence's token t lives in page
block_tables[b, t // block_size] at offset t % block_size. GQA: query head h reads KV head
h // (Hq / Hkv). Scores, softmax and the weighted sum are fp32; the output is rounded once.
The log-sum-exp (natural log, of the scaled scores) is what split-KV and cascades merge on.
"""

from __future__ import annotations

import torch


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Keys or values 0..length-1 of one sequence as [Hkv, length, D] float32."""
    block_size = cache.shape[2]
    pages = cache[table[: (length + block_size - 1) // block_size].long()]  # [n, Hkv, bs, D]
    return pages.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :length].float()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, D], k/v [Hkv, L, D] -> (out [Tq, Hq, D] fp32, lse [Tq, Hq] fp32)."""
    tq, hq, d = q.shape
    hkv = k.shape[0]
    qg = q.float().reshape(tq, hkv, hq // hkv, d)
    scores = torch.einsum("thgd,hld->thgl", qg, k) * scale
    if mask is not None:  # [Tq, L], True = visible
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("thgl,hld->thgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(tq, hq, d), lse.reshape(tq, hq)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
):
    """Decode attention: query b attends to keys 0..seq_lens[b]-1 of its sequence.

    q: [B, Hq, D]; block_tables: [B, max_blocks] int; seq_lens: [B] int (0 = padding: output
    zeros, lse -inf); scale defaults to D^-0.5. Returns out [B, Hq, D] in q.dtype, and
    lse [B, Hq] float32 when return_lse. Caches of any dtype are read as fp32; an fp8
    (float8_e4m3fn) cache holds k / k_scale and v / v_scale (reference.rope_and_cache), and
    attention is over the dequantized cache: scores q . K^T * scale * k_scale, output
    softmax(...) V * v_scale (default 1; the lse is of those scores).
    """
    b, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    if k_scale is not None:
        scale = scale * k_scale
    result = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    lengths = seq_lens.tolist()
    for group in _groups(lengths, k_cache.shape[1] * d):
        rows = torch.tensor(group, device=q.device)
        o, s = _attend_padded(
            q[rows],
            k_cache,
            v_cache,
            block_tables[rows],
            seq_lens[rows].long(),
            max(lengths[i] for i in group),
            scale,
        )
        result[rows], lse[rows] = o, s
    if v_scale is not None:
        result *= v_scale
    out = _store(result, q.dtype, out)
    return (out, lse) if return_lse else out


def _groups(lengths: list[int], elements_per_token: int, budget: int = 1 << 24) -> list[list[int]]:
    """Sequences with keys, in groups whose padded K (rows x longest x heads x D) stays within
    `budget` elements: batched math without an unbounded gather."""
    groups: list[list[int]] = []
    group: list[int] = []
    longest = 0
    for i in sorted((i for i, n in enumerate(lengths) if n > 0), key=lengths.__getitem__):
        longest = max(longest, lengths[i])
        if group and (len(group) + 1) * longest * elements_per_token > budget:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


def _attend_padded(q, k_cache, v_cache, tables, lengths, longest: int, scale: float):
    """Decode attention for a group of sequences at once, keys padded to the longest and masked.
    q [G, Hq, D] -> (out [G, Hq, D], lse [G, Hq]) in fp32."""
    g, hq, d = q.shape
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    nblk = -(-longest // block_size)
    positions = torch.arange(nblk * block_size, device=q.device)
    visible = positions[None, :] < lengths[:, None]  # [G, L]
    pages = torch.where(visible[:, ::block_size], tables[:, :nblk].long(), 0)  # unused -> page 0

    def gather(cache):  # [G, nblk, Hkv, bs, D] -> [G, Hkv, L, D], a fresh tensor
        # index_select copies whole [Hkv, bs, D] pages (cache[pages] walks them element by
        # element)
        keys = cache.index_select(0, pages.view(-1)).view(g, nblk, hkv, block_size, d)
        return keys.permute(0, 2, 1, 3, 4).reshape(g, hkv, -1, d).float()

    # Slots past a length may never have been written (NaN): their scores are masked to -inf
    # whatever the keys there, and their values zeroed (a zero weight times NaN is NaN).
    qg = q.float().reshape(g, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhld->bhgl", qg, gather(k_cache)) * scale
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    values = gather(v_cache).masked_fill_(~visible[:, None, :, None], 0.0)
    out = torch.einsum("bhgl,bhld->bhgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(g, hq, d), lse.reshape(g, hq)


# --- Fast CPU decode: the keys of every layer gathered once per step -----------------------
# paged_attention above gathers each layer's pages per call (a dozen small ops per layer); the
# CPU decode step (model/cpu_decode.py) instead gathers all layers' K/V of its sequences once,
# writes each layer's new token into that copy, and attends with three batched GEMM-shaped ops.
# Tested against paged_attention (tests/test_reference_attention.py).


def gather_decode_kv(
    kv_data: torch.Tensor, block_tables: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """All layers' keys and values of G sequences, [L, 2, Hkv, G, P, D] float32 (P = the
    longest length rounded up to whole blocks), from kv_data [L, 2, num_blocks, Hkv, bs, D].
    Unequal lengths: slots at or past each sequence's length are zeroed (never-written slots
    may hold NaN, and masked scores still multiply the values); equal lengths: left as read,
    paged_attention_gathered slices them off."""
    block_size = kv_data.shape[4]
    nblk = -(-max(lengths) // block_size)
    lens = torch.tensor(lengths, device=kv_data.device)
    starts = torch.arange(nblk, device=kv_data.device) * block_size
    pages = torch.where(starts[None, :] < lens[:, None], block_tables[:, :nblk].long(), 0)
    # index_select over the block dim of the permuted view copies whole [bs, D] pages (the
    # advanced index kv[:, :, :, pages] walks them element by element: ~2x slower here)
    kv = kv_data.permute(0, 1, 3, 2, 4, 5).index_select(3, pages.view(-1)).float()
    *lead, _, _, d = kv.shape  # [L, 2, Hkv, G * nblk, bs, D]
    if min(lengths) != max(lengths):
        past = torch.arange(nblk * block_size, device=kv.device)[None, :] >= lens[:, None]
        kv.view(*lead, -1, d).index_fill_(3, past.view(-1).nonzero().squeeze(1), 0.0)
    return kv.view(*lead, len(lengths), nblk * block_size, d)


def decode_bias(lengths: list[int], padded: int, num_kv_heads: int) -> torch.Tensor | None:
    """[Hkv * G, 1, padded] fp32: 0 where slot < length, -inf past it (the softmax mask of
    paged_attention_gathered), batch index kv_head * G + g; None when all lengths are equal."""
    if min(lengths) == max(lengths):
        return None
    lens = torch.tensor(lengths)
    past = torch.arange(padded)[None, :] >= lens[:, None]
    bias = torch.zeros(past.shape).masked_fill_(past, float("-inf"))
    return bias.repeat(num_kv_heads, 1)[:, None, :]


def paged_attention_gathered(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Decode attention over gathered keys: q [G, Hq, D] float32, k/v [Hkv, G, P, D] float32
    (one layer of gather_decode_kv), lengths [G] (each >= 1), bias from decode_bias (None when
    all lengths are equal: the keys are then sliced to the length, nothing to mask).
    Returns [Hkv, G, Hq / Hkv, D] float32: batch (kv head, sequence), its query group."""
    g, hq, d = q.shape
    hkv, _, padded, _ = k.shape
    if bias is None:
        padded = lengths[0]
        k, v = k[:, :, :padded], v[:, :, :padded]  # views: (Hkv, G) still merge
    q3 = q.view(g, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv * g, hq // hkv, d)
    k3, v3 = k.reshape(hkv * g, padded, d), v.reshape(hkv * g, padded, d)
    scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(scale)
    if bias is not None:
        scores.add_(bias)
    out = torch.bmm(torch.softmax(scores, dim=-1), v3)
    return out.view(hkv, g, hq // hkv, d)


def flash_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
):
    """Causal varlen prefill over the paged cache (fresh prompts, chunks, prefix-cache hits).

    q: [total_q, Hq, D], the query chunks of B sequences back to back, sequence b owning rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]; seq_lens[b]: keys of sequence b already in the cache,
    its cached prefix plus this chunk (so seq_lens[b] >= chunk length). Query i of a chunk of
    length n sits at position p = seq_lens[b] - n + i and sees keys 0..p.
    Returns out [total_q, Hq, D] in q.dtype, and lse [total_q, Hq] float32 when return_lse.

    The caches may be any float dtype, float8_e4m3fn included (read as fp32). Dequantization
    scales (the one definition, for every attention op that takes them): the keys attended to
    are k_scale * k_cache and the values v_scale * v_cache, each scale a finite positive number
    or None (= 1), so an fp8 cache that stores k / k_scale, v / v_scale gives attention over
    the dequantized cache. Equivalently: softmax scale times k_scale, output times v_scale (lse
    is that of the scores scale * q . (k_scale * k)).
    """
    total, hq, d = q.shape
    scale = (d**-0.5 if scale is None else scale) * (1.0 if k_scale is None else k_scale)
    result = torch.zeros(total, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((total, hq), float("-inf"), dtype=torch.float32, device=q.device)
    bounds = cu_seqlens_q.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        n = end - start
        if n == 0:
            continue
        if length < n:
            raise ValueError(f"seq_lens[{i}]={length} is shorter than its query chunk ({n})")
        k = _gather(k_cache, block_tables[i], length)
        v = _gather(v_cache, block_tables[i], length)
        query_pos = torch.arange(length - n, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]
        result[start:end], lse[start:end] = _attend(q[start:end], k, v, scale, mask)
    if v_scale is not None and v_scale != 1.0:
        result.mul_(v_scale)
    out = _store(result, q.dtype, out)
    return (out, lse) if return_lse else out


def merge_attention_states(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attention results over disjoint key sets (split-KV / flash-decoding).

    outs[i]: [..., D] fp32 attention over key set i; lses[i]: [...] its log-sum-exp. The merge is
    exact: out = sum_i exp(lse_i - lse) * out_i with lse = logsumexp_i lse_i. Empty sets carry
    lse = -inf and drop out.
    """
    lse_all = torch.stack(lses)
    lse = torch.logsumexp(lse_all, dim=0)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lse_all - finite)
    out = (weights[..., None] * torch.stack(outs)).sum(0)
    return out, lse


def _store(result: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result.to(dtype)
    out.copy_(result)
    return out
