"""rope_and_cache: validation, then csrc/rope_and_cache.cu or the reference."""

from __future__ import annotations

from . import support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    check_contiguous,
    check_disjoint,
    check_dtype,
    check_ndim,
    check_own_elements,
    check_same_dtype,
    check_shape,
    common_device,
    view,
)
from .index_checks import check_rope_indices
from .launch import (
    check_indices,
    host_backend,
    kernel_or_reference,
    kernel_variant,
    launch_context,
)
from .paged_kv import FP8_KV_DTYPE, check_heads, check_kv_cache, check_kv_scales


def rope_and_cache(
    q,
    k,
    v,
    positions,
    cos_sin,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    q_norm=None,
    k_norm=None,
    norm_eps: float = 1e-6,
    stream=None,
):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rotate-half, cos/sin from cos_sin
    [max_positions, D] float32 at positions [T] int32) and write k, v into k_cache/v_cache
    [num_blocks, Hkv, block_size, D] at slot_mapping [T] int32 (-1 = skip). The caches have
    q's dtype, or both are float8_e4m3fn: they then receive k / k_scale and v / v_scale as
    E4M3, saturated (reference.rope_and_cache defines it; the kernel covers float16/bfloat16
    q, k, v with fp8 caches). The reference checks positions and slots against the table and
    the cache (ValueError naming the entry); the kernel checks them on the device with
    PAGEDKERN_CHECK_INDICES=1.

    q_norm, k_norm: QK-norm weights [D] of q's dtype (both or neither; head_dim <= 512 in the
    kernel): every q and k head is first replaced by rms_norm(head, weight, norm_eps) (rounded
    to q's dtype, as reference.rms_norm), then rotated and cached: one pass instead of two norms,
    their copies out of the fused QKV view, and then this op."""
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    check_dtype(qv, FLOAT_DTYPES)
    check_ndim(qv, 3)
    tokens, _, head_dim = qv.shape
    if head_dim % 2:
        raise ValueError(f"{qv.describe()}: head dim must be even")
    check_heads(qv, tokens, head_dim)
    check_heads(kv, tokens, head_dim)
    check_heads(vv, tokens, head_dim)
    check_own_elements(qv)  # (q and k are rotated in place)
    check_own_elements(kv)
    if qv.ptr == kv.ptr and qv.numel:  # (fused QKV views start apart)
        raise ValueError(f"{qv.describe()} and {kv.describe()} are one array: each is rotated")
    check_same_dtype(qv, kv)
    check_same_dtype(qv, vv)
    if kv.shape[1] != vv.shape[1] or qv.shape[1] % kv.shape[1]:
        raise ValueError(
            f"{qv.describe()}, {kv.describe()}, {vv.describe()}: query heads must be "
            "a multiple of the KV heads, and k and v must have the same heads"
        )
    pv, cv = view(positions, "positions"), view(cos_sin, "cos_sin")
    sv = view(slot_mapping, "slot_mapping")
    for idx in (pv, sv):
        check_dtype(idx, ("int32",))
        check_shape(idx, (tokens,))
        check_contiguous(idx)
    check_dtype(cv, ("float32",))
    check_shape(cv, (None, head_dim))
    check_contiguous(cv)
    kc, vc = view(k_cache, "k_cache"), view(v_cache, "v_cache")
    check_kv_cache(kc, kv, kv.shape[1], head_dim, fp8=True)
    check_kv_cache(vc, kv, kv.shape[1], head_dim, fp8=True)
    check_same_dtype(kc, vc)
    check_shape(vc, kc.shape)
    check_disjoint(kc, vc)
    check_kv_scales(kc, k_scale, v_scale)
    views = [qv, kv, vv, pv, cv, kc, vc, sv]
    norms = _check_norms(qv, q_norm, k_norm, norm_eps)
    common_device(views + norms)
    decision = support.rope_and_cache(qv.dtype, kc.dtype, head_dim if norms else None)
    if not kernel_or_reference("rope_and_cache", views + norms, decision):
        from ..reference import rms_norm
        from ..reference import rope_and_cache as reference

        check_rope_indices(positions, slot_mapping, cv.shape[0], kc.shape[0] * kc.shape[2])
        if host_backend(views) == "cpu":  # the CPU backend's (ops/cpu/rope.py), norms fused
            from .cpu import implementations, rope

            rope.begin_step()  # (this call's tensors may be another step's, refilled in place)
            implementations.rope_and_cache(
                q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps,
            )  # fmt: skip
            return
        if norms:  # in place, as the kernel: the heads of q and k normalised, then rotated
            q.copy_(rms_norm(q, q_norm, norm_eps))
            k.copy_(rms_norm(k, k_norm, norm_eps))
        reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if tokens == 0:
        return
    module, device, handle = launch_context(views, stream)
    module.rope_and_cache(
        q=qv.ptr,
        k=kv.ptr,
        v=vv.ptr,
        positions=pv.ptr,
        cos_sin=cv.ptr,
        k_cache=kc.ptr,
        v_cache=vc.ptr,
        slot_mapping=sv.ptr,
        q_stride=qv.strides[0],
        k_stride=kv.strides[0],
        v_stride=vv.strides[0],
        tokens=tokens,
        max_positions=cv.shape[0],
        num_blocks=kc.shape[0],
        num_heads=qv.shape[1],
        num_kv_heads=kv.shape[1],
        head_dim=head_dim,
        block_size=kc.shape[2],
        dtype=DTYPE_CODES[qv.dtype],
        check_indices=check_indices(),
        device=device,
        stream=handle,
        variant=kernel_variant("rope_and_cache"),
        kv_fp8=kc.dtype == FP8_KV_DTYPE,
        k_scale=float(1.0 if k_scale is None else k_scale),
        v_scale=float(1.0 if v_scale is None else v_scale),
        q_norm=norms[0].ptr if norms else 0,
        k_norm=norms[1].ptr if norms else 0,
        norm_eps=float(norm_eps),
    )


def _check_norms(qv, q_norm, k_norm, norm_eps) -> list:
    """The QK-norm weights' views ([] without QK-norm): both or neither, [D] contiguous of q's
    dtype; norm_eps a finite number >= 0."""
    if q_norm is None and k_norm is None:
        return []
    if q_norm is None or k_norm is None:
        raise ValueError("q_norm and k_norm go together: pass both or neither")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)):
        raise ValueError(f"norm_eps must be a number >= 0, got {norm_eps!r}")
    if not 0 <= norm_eps < float("inf"):
        raise ValueError(f"norm_eps must be a finite number >= 0, got {norm_eps!r}")
    norms = [view(q_norm, "q_norm"), view(k_norm, "k_norm")]
    for w in norms:
        check_same_dtype(qv, w)
        check_shape(w, (qv.shape[2],))
        check_contiguous(w)
    return norms
