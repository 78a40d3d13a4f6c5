"""The gated activations silu_and_mul (SwiGLU) and gelu_tanh_and_mul (GeGLU): validation, then
csrc/silu_and_mul.cu (one kernel pair, the activation a template parameter) or the reference."""

from __future__ import annotations

from . import support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    check_dtype,
    check_own_elements,
    check_same_dtype,
    check_shape,
    empty_like,
    rows_of,
    view,
)
from .launch import host_ops, kernel_or_reference, launch_context

# csrc/silu_and_mul.h GatedActivation, exported as _C.GATED_ACTIVATIONS (a test compares them)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def silu_and_mul(x, out=None, *, stream=None):
    """out = silu(x[..., :d]) * x[..., d:] for x [..., 2d] float32/float16/bfloat16."""
    return _gated("silu_and_mul", "silu", x, out, stream)


def gelu_tanh_and_mul(x, out=None, *, stream=None):
    """out = gelu(x[..., :d], approximate="tanh") * x[..., d:] for x [..., 2d]
    float32/float16/bfloat16 (Gemma's GeGLU)."""
    return _gated("gelu_tanh_and_mul", "gelu_tanh", x, out, stream)


def _gated(op: str, activation: str, x, out, stream):
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
        check_own_elements(ov)
        views.append(ov)
    if not kernel_or_reference(op, views, support.elementwise(xv.dtype)):
        return getattr(host_ops(views), op)(x, out=out)
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
        activation=ACTIVATIONS[activation],
        device=device,
        stream=handle,
    )
    return out
