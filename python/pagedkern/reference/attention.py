"""Attention over the paged KV cache: decode (one query per sequence) and causal varlen prefill.

Cache pages are [num_blocks, Hkv, block_size, D] (HND); a sequence's token t lives in page
block_tables[b, t // block_size] at offset t % block_size. GQA: query head h reads KV head
h // (Hq / Hkv). Scores, softmax and the weighted sum are fp32; the output is rounded once.
The log-sum-exp (natural log, of the scaled scores) is what split-KV and cascades merge on.
The keys both ops read, in whole blocks, and the query rows they pad for batch invariance:
key_blocks.py.

Both ops take the same options, defined once in ATTENTION_OPTIONS: a left `sliding_window`,
logit `soft_cap`ping and attention `sinks`.
"""

from __future__ import annotations

import torch

from .key_blocks import MIN_GEMM_ROWS, first_block, gather_pages, key_blocks, with_min_rows


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
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Decode attention: query b attends to keys 0..seq_lens[b]-1 of its sequence.

    q: [B, Hq, D]; block_tables: [B, max_blocks] int; seq_lens: [B] int (0 = padding: output
    zeros, lse -inf); scale defaults to D^-0.5. Returns out [B, Hq, D] in q.dtype, and
    lse [B, Hq] float32 when return_lse. Caches of any dtype are read as fp32; an fp8
    (float8_e4m3fn) cache holds k / k_scale and v / v_scale (reference.rope_and_cache), and
    attention is over the dequantized cache: scores q . K^T * scale * k_scale, output
    softmax(...) V * v_scale (default 1; the lse is of those scores). The query sits at position
    seq_lens[b] - 1; sliding_window, soft_cap, sinks: see ATTENTION_OPTIONS.
    """
    b, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    if k_scale is not None:
        scale = scale * k_scale
    result = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = None
    if return_lse:
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
            scale,
            return_lse,
            sliding_window,
            soft_cap,
            sinks,
        )
        result[rows] = o
        if lse is not None:
            lse[rows] = s
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


ATTENTION_OPTIONS = """
    sliding_window: None, or an int >= 1: the query at position p sees only keys at positions k
    with p - k < sliding_window (HF transformers' convention: a window of 1 is the query's own
    key; keys older than the window are masked as if absent).
    soft_cap: None, or a finite number > 0: each scaled score s becomes cap * tanh(s / cap)
    before masking and the softmax (Gemma 2's attn_logit_softcapping).
    sinks: None, or a [Hq] float32 tensor: a learned logit per query head that joins every
    softmax's denominator and no numerator (gpt-oss): the weights sum to
    1 - exp(sink - lse), and the lse is that of the scores and the sink together.
"""


def _soft_capped(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) in place, in HF's order of operations (divide, tanh, multiply)."""
    if soft_cap is None:
        return scores
    return scores.div_(soft_cap).tanh_().mul_(soft_cap)


def _with_sink(scores: torch.Tensor, sinks: torch.Tensor | None, shape: tuple[int, ...]):
    """scores [..., W] with the sink logit appended as column W (sinks [Hq] viewed as `shape`,
    broadcast over the rest), or scores itself without sinks."""
    if sinks is None:
        return scores
    column = sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1)


def _attend_padded(
    q,
    k_cache,
    v_cache,
    tables,
    lengths,
    scale: float,
    need_lse: bool,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Decode attention for a group of sequences at once, keys padded to the longest and masked.
    q [G, Hq, D] -> (out [G, Hq, D], lse [G, Hq] or None unless need_lse) in fp32."""
    g, hq, d = q.shape
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    first = [first_block(n, n - 1, window, block_size) for n in lengths.tolist()]
    first = torch.tensor(first, device=q.device)  # (the query sits at lengths - 1)
    pages, positions = key_blocks(tables, lengths, first, block_size)
    visible = positions < lengths[:, None]  # [G, L]
    if window is not None:
        visible &= positions >= (lengths - window)[:, None]

    # Slots past a length may never have been written (NaN): their scores are masked to -inf
    # whatever the keys there, and their values zeroed (a zero weight times NaN is NaN).
    group = hq // hkv
    qg = with_min_rows(q.float().reshape(g, hkv, group, d), 2)  # (see MIN_GEMM_ROWS)
    keys = gather_pages(k_cache, pages, (1, 3, 4)).view(g, hkv, -1, d)
    scores = _soft_capped(torch.einsum("bhgd,bhld->bhgl", qg, keys) * scale, soft_cap)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:  # the query rows' sinks; the padding rows' are dropped with them
        sinks = with_min_rows(sinks.float().view(hkv, group), 1)
    scores = _with_sink(scores, sinks, (1, hkv, -1, 1))
    lse = torch.logsumexp(scores[:, :, :group], dim=-1).reshape(g, hq) if need_lse else None
    values = gather_pages(v_cache, pages, (1, 3, 4)).view(g, hkv, -1, d)
    values.masked_fill_(~visible[:, None, :, None], 0.0)
    weights = torch.softmax(scores, dim=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    out = torch.einsum("bhgl,bhld->bhgd", weights, values)
    return out[:, :, :group].reshape(g, hq, d), lse


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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
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
    is that of the scores scale * q . (k_scale * k)). sliding_window, soft_cap, sinks: see
    ATTENTION_OPTIONS.
    """
    total, hq, d = q.shape
    scale = (d**-0.5 if scale is None else scale) * (1.0 if k_scale is None else k_scale)
    result = torch.zeros(total, hq, d, dtype=torch.float32, device=q.device)
    lse = None
    if return_lse:
        lse = torch.full((total, hq), float("-inf"), dtype=torch.float32, device=q.device)
    bounds, lengths = cu_seqlens_q.tolist(), seq_lens.tolist()
    chunks = [bounds[i + 1] - bounds[i] for i in range(len(lengths))]
    for i, (n, length) in enumerate(zip(chunks, lengths, strict=True)):
        if length < n:
            raise ValueError(f"seq_lens[{i}]={length} is shorter than its query chunk ({n})")
    bs = k_cache.shape[2]
    first = [first_block(n, n - c, sliding_window, bs) for c, n in zip(chunks, lengths)]
    for group in _prefill_groups(chunks, lengths, bs, hq, first):
        starts = [bounds[i] for i in group]
        rows, o, s = _prefill_padded(
            q, k_cache, v_cache, block_tables[group], starts, [chunks[i] for i in group],
            [lengths[i] for i in group], [first[i] for i in group], scale, return_lse,
            sliding_window, soft_cap, sinks,
        )  # fmt: skip
        result[rows] = o
        if lse is not None:
            lse[rows] = s
    if v_scale is not None and v_scale != 1.0:
        result.mul_(v_scale)
    out = _store(result, q.dtype, out)
    return (out, lse) if return_lse else out


def _prefill_groups(
    chunks: list[int],
    lengths: list[int],
    block_size: int,
    hq: int,
    first: list[int] | None = None,
    budget: int = 1 << 24,
) -> list[list[int]]:
    """Sequences with a query chunk in groups computed as one padded batch: the same number
    of key blocks (every sequence's keys padded to its own whole blocks, so its softmax and
    sums never depend on its neighbours: torch's CPU softmax rounds differently at another
    width), chunks padded to the group's longest, the group's scores (rows x longest chunk x
    heads x width) within `budget` elements and its padded rows at most twice its real ones.
    first[i]: sequence i's first key block read (a window's), 0 by default."""
    first = first or [0] * len(chunks)
    by_blocks: dict[int, list[int]] = {}
    for i in sorted((i for i, n in enumerate(chunks) if n > 0), key=chunks.__getitem__):
        by_blocks.setdefault(-(-lengths[i] // block_size) - first[i], []).append(i)
    groups: list[list[int]] = []
    for nblk, members in by_blocks.items():
        group: list[int] = []
        rows = 0
        for i in members:  # by chunk length: the last one added is the longest
            padded = (len(group) + 1) * chunks[i]
            if group and (
                padded * nblk * block_size * hq > budget or padded > 2 * (rows + chunks[i])
            ):
                groups.append(group)
                group, rows = [], 0
            group.append(i)
            rows += chunks[i]
        groups.append(group)
    return groups


def _prefill_padded(
    q,
    k_cache,
    v_cache,
    tables,
    starts,
    chunks,
    lengths,
    first_blocks,
    scale: float,
    need_lse: bool,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Causal prefill attention of a group of S sequences of as many key blocks at once: chunks
    padded to the longest (T), keys to the whole blocks (W), masked. Per query row the same
    products, softmax and sums as attending alone (rows are independent; padded rows are
    dropped), so a sequence's output does not depend on its group. -> (rows of q, out, lse or
    None) for the chunks' rows back to back: [sum(chunks)], [sum(chunks), Hq, D] and
    [sum(chunks), Hq] fp32."""
    hq, d = q.shape[1:]
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    # At least MIN_GEMM_ROWS query rows a GEMM (T x G), or a short chunk's rows would hang on
    # its group's longest chunk (and a one-token chunk differ from the same token's decode)
    group = len(chunks)
    t_max = max(max(chunks), -(-MIN_GEMM_ROWS // (hq // hkv)))
    n, lens, first = (torch.tensor(x, device=q.device) for x in (chunks, lengths, starts))
    step = torch.arange(t_max, device=q.device)
    real = step[None, :] < n[:, None]  # [S, T]: rows that are queries, not padding
    rows = torch.where(real, first[:, None] + step[None, :], first[:, None])
    positions = (lens - n)[:, None] + step[None, :]  # [S, T], each query's position
    blocks = torch.tensor(first_blocks, device=q.device)
    pages, slots = key_blocks(tables, lens, blocks, block_size)  # slots: [S, W] key positions
    width = slots.shape[1]
    hidden = slots[:, None, :] > positions[:, :, None]  # [S, T, W]: causal (so < length)
    if window is not None:  # and keys window or more positions back
        hidden |= slots[:, None, :] <= positions[:, :, None] - window

    qg = q.index_select(0, rows.view(-1)).float().view(group, t_max, hkv, hq // hkv, d)
    qg = qg.permute(0, 2, 1, 3, 4).reshape(group * hkv, -1, d)  # [S * Hkv, T * G, D]
    # Keys as [D, W] rows: with the transposed view torch's CPU bmm rounds few-row products
    # (T * G < 6) differently from many-row ones, so a chunk's scores hung on its group's T
    keys = gather_pages(k_cache, pages, (4, 1, 3)).view(group * hkv, d, width)  # [D, W] a head
    scores = _soft_capped(torch.bmm(qg, keys).mul_(scale), soft_cap)
    scores = scores.view(group, hkv, t_max, -1, width)
    scores.masked_fill_(hidden[:, None, :, None, :], float("-inf"))
    scores = _with_sink(scores, sinks, (1, hkv, 1, -1, 1))
    lse = None
    if need_lse:  # max + log(sum(exp)): -log_softmax at the max, a row op like the softmax
        # (torch.logsumexp's elementwise exp rounds by where a row falls in the tensor)
        lse = scores.amax(-1) - torch.log_softmax(scores, dim=-1).amax(-1)
        lse = lse.permute(0, 2, 1, 3)
    # Slots past a length may never have been written (NaN): zero weights times NaN is NaN
    values = gather_pages(v_cache, pages, (1, 3, 4)).view(group, hkv, width, d)
    values.masked_fill_((slots >= lens[:, None])[:, None, :, None], 0.0)
    weights = torch.softmax(scores, dim=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    weights = weights.reshape(group * hkv, -1, width)
    out = torch.bmm(weights, values.view(group * hkv, width, d))
    out = out.view(group, hkv, t_max, -1, d).permute(0, 2, 1, 3, 4)[real].reshape(-1, hq, d)
    return rows[real], out, None if lse is None else lse[real].reshape(-1, hq)


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
