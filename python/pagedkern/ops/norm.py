"""rms_norm and fused_add_rms_norm: validation, then csrc/rms_norm.cu or the reference."""

from __future__ import annotations

from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    check_dtype,
    check_same_dtype,
    check_shape,
    empty_like,
    rows_of,
    view,
)
from .launch import kernel_variant, launch_context, use_reference


def _check_eps(eps: float) -> float:
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    return float(eps)


def rms_norm(x, weight, eps: float = 1e-6, out=None, *, stream=None):
    """out = x * rsqrt(mean(x^2, -1) + eps) * weight. x: [..., H] float32/float16/bfloat16
    (leading dimensions collapsible into rows, last one contiguous); weight: [H] same dtype."""
    eps = _check_eps(eps)
    xv, wv = view(x, "x"), view(weight, "weight")
    check_dtype(xv, FLOAT_DTYPES)
    check_same_dtype(xv, wv)
    check_shape(wv, (xv.shape[-1] if xv.ndim else None,))
    rows, x_stride = rows_of(xv)
    views = [xv, wv]
    if out is not None:
        ov = view(out, "out")
        check_same_dtype(xv, ov)
        check_shape(ov, xv.shape)
        rows_of(ov)
        views.append(ov)
    if use_reference(views):
        from ..reference import rms_norm as reference

        return reference(x, weight, eps, out=out)
    module, device, handle = launch_context(views, stream)
    if out is None:
        out = empty_like(xv, xv.shape)
        ov = view(out, "out")
    module.rms_norm(
        ov.ptr,
        xv.ptr,
        0,
        wv.ptr,
        rows,
        xv.shape[-1],
        rows_of(ov)[1],
        x_stride,
        0,
        eps,
        DTYPE_CODES[xv.dtype],
        device,
        handle,
        kernel_variant("rms_norm"),
    )
    return out


def fused_add_rms_norm(x, residual, weight, eps: float = 1e-6, *, stream=None):
    """In place: residual = x + residual; x = rms_norm(residual, weight, eps). Returns
    (x, residual). x, residual: [..., H], same dtype and shape; weight: [H]."""
    eps = _check_eps(eps)
    xv, rv, wv = view(x, "x"), view(residual, "residual"), view(weight, "weight")
    check_dtype(xv, FLOAT_DTYPES)
    check_same_dtype(xv, rv)
    check_same_dtype(xv, wv)
    check_shape(rv, xv.shape)
    check_shape(wv, (xv.shape[-1] if xv.ndim else None,))
    rows, x_stride = rows_of(xv)
    _, residual_stride = rows_of(rv)
    if use_reference([xv, rv, wv]):
        from ..reference import fused_add_rms_norm as reference

        return reference(x, residual, weight, eps)
    module, device, handle = launch_context([xv, rv, wv], stream)
    module.rms_norm(
        xv.ptr,
        xv.ptr,
        rv.ptr,
        wv.ptr,
        rows,
        xv.shape[-1],
        x_stride,
        x_stride,
        residual_stride,
        eps,
        DTYPE_CODES[xv.dtype],
        device,
        handle,
        kernel_variant("rms_norm"),
    )
    return x, residual
