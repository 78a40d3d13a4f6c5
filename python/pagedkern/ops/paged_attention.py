"""paged_attention (decode): validation, then the reference (its CUDA kernel lands with the
decode-kernel issue)."""

from __future__ import annotations

from .arrays import check_shape, common_device
from .launch import reference_on_torch
from .paged_kv import check_attention_args, check_scale


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale=None,
    out=None,
    return_lse=False,
    *,
    stream=None,
):
    """Decode attention, one query per sequence: q [B, Hq, D]; caches [N, Hkv, bs, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (0 = padding, output zeros).
    Returns out [B, Hq, D] (and lse [B, Hq] float32 with return_lse)."""
    check_scale(scale)
    qv, views = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, None, out)
    check_shape(views[4], (qv.shape[0],))
    common_device(views)
    reference = reference_on_torch("paged_attention", views)
    return reference.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, return_lse
    )
