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
):
    """Decode attention: query b attends to keys 0..seq_lens[b]-1 of its sequence.

    q: [B, Hq, D]; block_tables: [B, max_blocks] int; seq_lens: [B] int (0 = padding: output
    zeros, lse -inf); scale defaults to D^-0.5. Returns out [B, Hq, D] in q.dtype, and
    lse [B, Hq] float32 when return_lse.
    """
    b, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    result = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i, length in enumerate(seq_lens.tolist()):
        if length > 0:
            k = _gather(k_cache, block_tables[i], length)
            v = _gather(v_cache, block_tables[i], length)
            o, s = _attend(q[i : i + 1], k, v, scale, None)
            result[i], lse[i] = o[0], s[0]
    out = _store(result, q.dtype, out)
    return (out, lse) if return_lse else out


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
):
    """Causal varlen prefill over the paged cache (fresh prompts, chunks, prefix-cache hits).

    q: [total_q, Hq, D], the query chunks of B sequences back to back, sequence b owning rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]; seq_lens[b]: keys of sequence b already in the cache,
    its cached prefix plus this chunk (so seq_lens[b] >= chunk length). Query i of a chunk of
    length n sits at position p = seq_lens[b] - n + i and sees keys 0..p.
    Returns out [total_q, Hq, D] in q.dtype, and lse [total_q, Hq] float32 when return_lse.
    """
    total, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
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
