"""rms_norm and fused_add_rms_norm: validation, then csrc/rms_norm.cu or the reference."""

from __future__ import annotations

import math

from . import support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    check_disjoint,
    check_dtype,
    check_own_elements,
    check_same_dtype,
    check_shape,
    empty_like,
    rows_of,
    view,
)
from .launch import host_ops, kernel_or_reference, kernel_variant, launch_context


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite non-negative number, got {eps!r}")
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
        check_own_elements(ov)
        views.append(ov)
    if not kernel_or_reference("rms_norm", views, support.elementwise(xv.dtype)):
        return host_ops(views).rms_norm(x, weight, eps, out=out)
    module, device, handle = launch_context(views, stream)
    if out is None:
        out = empty_like(xv, xv.shape)
        ov = view(out, "out")
    module.rms_norm(
        out=ov.ptr,
        x=xv.ptr,
        residual=0,
        weight=wv.ptr,
        rows=rows,
        hidden=xv.shape[-1],
        out_stride=rows_of(ov)[1],
        x_stride=x_stride,
        residual_stride=0,
        eps=eps,
        dtype=DTYPE_CODES[xv.dtype],
        device=device,
        stream=handle,
        variant=kernel_variant("rms_norm"),
    )
    return out


def fused_add_rms_norm(x, residual, weight, eps: float = 1e-6, *, stream=None):
    """In place: residual = x + residual; x = rms_norm(residual, weight, eps). Returns
    (x, residual). x, residual: [..., H], same dtype and shape, not sharing memory; weight: [H]."""
    eps = _check_eps(eps)
    xv, rv, wv = view(x, "x"), view(residual, "residual"), view(weight, "weight")
    check_dtype(xv, FLOAT_DTYPES)
    check_same_dtype(xv, rv)
    check_same_dtype(xv, wv)
    check_shape(rv, xv.shape)
    check_shape(wv, (xv.shape[-1] if xv.ndim else None,))
    rows, x_stride = rows_of(xv)
    _, residual_stride = rows_of(rv)
    check_own_elements(xv)  # (both written in place)
    check_own_elements(rv)
    check_disjoint(xv, rv)  # the kernel reads x and residual after writing both
    if not kernel_or_reference("fused_add_rms_norm", [xv, rv, wv], support.elementwise(xv.dtype)):
        return host_ops([xv, rv, wv]).fused_add_rms_norm(x, residual, weight, eps)
    module, device, handle = launch_context([xv, rv, wv], stream)
    module.rms_norm(
        out=xv.ptr,
        x=xv.ptr,
        residual=rv.ptr,
        weight=wv.ptr,
        rows=rows,
        hidden=xv.shape[-1],
        out_stride=x_stride,
        x_stride=x_stride,
        residual_stride=residual_stride,
        eps=eps,
        dtype=DTYPE_CODES[xv.dtype],
        device=device,
        stream=handle,
        variant=kernel_variant("rms_norm"),
    )
    return x, residual
