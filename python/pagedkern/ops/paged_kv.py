"""Checks shared by every op that touches the paged KV cache: packed heads, the page layout
[num_blocks, Hkv, block_size, D] and the attention arguments (queries, caches, tables, lengths)."""

from __future__ import annotations

import math

from .arrays import (
    FLOAT_DTYPES,
    ArrayView,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_own_elements,
    check_same_dtype,
    check_shape,
    common_device,
    empty_like,
    view,
)
from .support import FP8_KV_DTYPE, HALF_DTYPES


def check_heads(a: ArrayView, tokens: int, head_dim: int) -> None:
    """[tokens, heads, head_dim] with packed heads; the token stride is free (fused QKV views)."""
    check_ndim(a, 3)
    check_shape(a, (tokens, None, head_dim))
    if a.shape[1] > 1 and a.strides[1] != head_dim or head_dim > 1 and a.strides[2] != 1:
        raise ValueError(
            f"{a.describe()}: heads must be packed (strides (*, D, 1)), got {a.strides}"
        )


def check_kv_cache(
    cache: ArrayView, like: ArrayView, num_kv_heads: int, head_dim: int, fp8: bool = False
) -> None:
    """[num_blocks, Hkv, block_size, D] pages, contiguous, in the dtype of `like`, bfloat16 or
    float16 under a float32 `like`, or (fp8: ops that read and write E4M3 caches)
    float8_e4m3fn."""
    check_ndim(cache, 4)
    check_shape(cache, (None, num_kv_heads, None, head_dim))
    # a cache of half the bytes under float32 activations (the CPU backend's --kv-cache-dtype)
    narrow = like.dtype == "float32" and cache.dtype in HALF_DTYPES
    if cache.dtype != like.dtype and not narrow and not (fp8 and cache.dtype == FP8_KV_DTYPE):
        also = " (or bfloat16, float16 under float32)"
        also += f" or {FP8_KV_DTYPE}" if fp8 else ""
        raise TypeError(f"{cache.describe()} must have the dtype of {like.describe()}{also}")
    check_contiguous(cache)


def check_kv_scales(cache: ArrayView, k_scale, v_scale) -> None:
    """k_scale / v_scale: None, or finite positive numbers for an fp8 cache."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if cache.dtype != FP8_KV_DTYPE:
            raise ValueError(
                f"{name} applies to an fp8 ({FP8_KV_DTYPE}) cache, not {cache.describe()}"
            )
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 0 < scale < math.inf
        ):
            raise ValueError(f"{name} must be a finite positive number or None, got {scale!r}")


def attention_views(q, k_cache, v_cache, block_tables, seq_lens, out) -> list[ArrayView]:
    """One view per attention argument: [q, k_cache, v_cache, block_tables, seq_lens(, out)]."""
    views = [
        view(q, "q"),
        view(k_cache, "k_cache"),
        view(v_cache, "v_cache"),
        view(block_tables, "block_tables"),
        view(seq_lens, "seq_lens"),
    ]
    if out is not None:
        views.append(view(out, "out"))
        check_own_elements(views[-1])
    return views


def check_attention_views(
    views: list[ArrayView], batch_size: int | None, fp8: bool = False
) -> None:
    """The checks of check_attention_args on views made by attention_views (fp8: the op reads
    float8_e4m3fn caches too; both caches then share that dtype)."""
    qv, kc, vc, bt, sl = views[:5]
    check_dtype(qv, FLOAT_DTYPES)
    check_ndim(qv, 3)
    tokens, num_heads, head_dim = qv.shape
    check_heads(qv, tokens, head_dim)
    check_ndim(kc, 4)
    check_kv_cache(kc, qv, kc.shape[1], head_dim, fp8)
    check_kv_cache(vc, qv, kc.shape[1], head_dim, fp8)
    check_same_dtype(kc, vc)
    check_shape(vc, kc.shape)
    if kc.shape[1] == 0 or num_heads % kc.shape[1]:
        raise ValueError(
            f"{qv.describe()}: query heads must be a multiple of the KV heads of {kc.describe()}"
        )
    check_dtype(bt, ("int32",))
    check_dtype(sl, ("int32",))
    batch = batch_size if batch_size is not None else sl.shape[0] if sl.ndim == 1 else -1
    check_shape(bt, (batch, None))
    check_shape(sl, (batch,))
    if len(views) > 5:
        ov = views[5]
        check_same_dtype(qv, ov)
        check_shape(ov, qv.shape)


def check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, batch_size, out):
    views = attention_views(q, k_cache, v_cache, block_tables, seq_lens, out)
    check_attention_views(views, batch_size)
    return views[0], views


def check_attention_options(qv: ArrayView, sliding_window, soft_cap, sinks) -> ArrayView | None:
    """The attention options (reference.attention.ATTENTION_OPTIONS): sliding_window None or
    an int in [1, 2^31), soft_cap None or a finite number > 0, sinks None or a float32 [Hq] array on
    q's device. Returns the sinks' view."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or not 1 <= sliding_window < 2**31  # (the kernels' int32)
    ):
        raise ValueError(
            f"sliding_window must be an int in [1, 2^31) or None, got {sliding_window!r}"
        )
    if soft_cap is not None and (
        isinstance(soft_cap, bool)
        or not isinstance(soft_cap, (int, float))
        or not 0 < soft_cap < math.inf
    ):
        raise ValueError(f"soft_cap must be a finite positive number or None, got {soft_cap!r}")
    if sinks is None:
        return None
    sv = view(sinks, "sinks")
    check_dtype(sv, ("float32",))
    check_shape(sv, (qv.shape[1],))
    common_device([qv, sv])
    return sv


def check_sinks_layout(sv: ArrayView | None) -> None:
    """The kernels read the sink logits as a contiguous float32 array."""
    if sv is not None and sv.shape[0] > 1 and sv.strides[0] != 1:
        raise ValueError(f"{sv.describe()} must be contiguous for the kernel")


def check_scale(scale):
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite positive number or None, got {scale!r}")


def check_rows_aligned(a: ArrayView) -> None:
    """Rows (tokens) start at 16-byte boundaries: the kernels move heads with 16-byte accesses."""
    if a.ptr % 16 or (a.shape[0] > 1 and a.strides[0] % 8):
        raise ValueError(f"{a.describe()}: rows must start at 16-byte boundaries for the kernel")


def check_out(qv: ArrayView, ov: ArrayView) -> None:
    """An attention output for the kernels: packed heads of q's shape, 16-byte aligned rows."""
    check_heads(ov, qv.shape[0], qv.shape[2])
    check_rows_aligned(ov)


def attention_outputs(qv: ArrayView, out, return_lse: bool, ov: ArrayView | None = None):
    """(out, its view, lse or None) for an attention kernel: `out` allocated like q unless given,
    lse [tokens, Hq] float32 when asked for. `ov`: the caller's view of the given `out`, already
    through check_out (the caller's checks were memoised)."""
    tokens, num_heads, head_dim = qv.shape
    if out is None:
        out = empty_like(qv, qv.shape)
    if ov is None or ov.obj is not out:
        ov = view(out, "out")
        check_out(qv, ov)
    lse = empty_like(qv, (tokens, num_heads), "float32", "lse") if return_lse else None
    return out, ov, lse


def workspace_view(
    workspace, qv: ArrayView, need: int, dtype: str, views: list[ArrayView]
) -> ArrayView:
    """The kernel's scratch array: the caller's (CUDA-graph capture passes a fixed one), checked
    for dtype, size, alignment and device, or a new one."""
    if workspace is None:
        workspace = empty_like(qv, (need,), dtype, "workspace")
    wv = view(workspace, "workspace")
    check_dtype(wv, (dtype,))
    check_contiguous(wv)
    common_device([*views, wv])
    if wv.numel < need or wv.ptr % 16:
        raise ValueError(f"{wv.describe()}: need {need} {dtype} elements, 16-byte aligned")
    return wv
