"""flash_prefill (causal varlen prefill over the paged cache): validation, then the reference (its
CUDA kernel lands with the prefill issue)."""

from __future__ import annotations

from .arrays import check_dtype, check_ndim, common_device, view
from .launch import reference_on_torch
from .paged_kv import check_attention_args, check_scale


def flash_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    scale=None,
    out=None,
    return_lse=False,
    *,
    stream=None,
):
    """Causal varlen prefill over the paged cache: q [total_q, Hq, D] holds B query chunks
    delimited by cu_seqlens_q [B+1] int32; seq_lens [B] int32 counts each sequence's keys in the
    cache (prefix + chunk). Returns out [total_q, Hq, D] (and lse [total_q, Hq] float32)."""
    check_scale(scale)
    cu = view(cu_seqlens_q, "cu_seqlens_q")
    check_dtype(cu, ("int32",))
    check_ndim(cu, 1)
    if cu.shape[0] < 1:
        raise ValueError(f"{cu.describe()} must hold at least one entry")
    _, views = check_attention_args(
        q, k_cache, v_cache, block_tables, seq_lens, cu.shape[0] - 1, out
    )
    views.append(cu)
    common_device(views)
    reference = reference_on_torch("flash_prefill", views)
    return reference.flash_prefill(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, out, return_lse
    )
