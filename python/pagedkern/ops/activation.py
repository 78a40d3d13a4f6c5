"""silu_and_mul: validation, then csrc/silu_and_mul.cu or the reference."""

from __future__ import annotations

from . import support
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
from .launch import kernel_or_reference, launch_context


def silu_and_mul(x, out=None, *, stream=None):
    """out = silu(x[..., :d]) * x[..., d:] for x [..., 2d] float32/float16/bfloat16."""
    xv = view(x, "x")
    check_dtype(xv, FLOAT_DTYPES)
    if xv.ndim == 0 or xv.shape[-1] % 2:
        raise ValueError(f"{xv.describe()}: the last dimension must be even (gate and up halves)")
    rows, x_stride = rows_of(xv)
    shape = (*xv.shape[:-1], xv.shape[-1] // 2)
    views = [xv]
    if out is not None:
        ov = view(out, "out")
        check_same_dtype(xv, ov)
        check_shape(ov, shape)
        rows_of(ov)
        views.append(ov)
    if not kernel_or_reference("silu_and_mul", views, support.elementwise(xv.dtype)):
        from ..reference import silu_and_mul as reference

        return reference(x, out=out)
    module, device, handle = launch_context(views, stream)
    if out is None:
        out = empty_like(xv, shape)
        ov = view(out, "out")
    module.silu_and_mul(
        out=ov.ptr,
        x=xv.ptr,
        rows=rows,
        d=shape[-1],
        out_stride=rows_of(ov)[1],
        x_stride=x_stride,
        dtype=DTYPE_CODES[xv.dtype],
        device=device,
        stream=handle,
    )
    return out
