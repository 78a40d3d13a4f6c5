"""sample: validation, per-row parameters as device arrays, then csrc/sampling.cu or the
reference."""

from __future__ import annotations

from . import support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_shape,
    common_device,
    empty_like,
    full_like,
    view,
)
from .launch import kernel_or_reference, launch_context, reference_on_torch

_PARAMS = (
    ("temperature", "float32"),
    ("top_p", "float32"),
    ("top_k", "int32"),
    ("seeds", "int64"),
    ("offsets", "int64"),
)
_INT32 = (-(2**31), 2**31 - 1)


def sample(logits, temperature, top_p, top_k, seeds, offsets=0, out=None, *, stream=None):
    """One token id per row of logits [B, V] (int32 [B]). Per-row parameters, as [B] arrays or
    Python numbers: temperature float32 (<= 0: greedy), top_p float32 (>= 1: off), top_k int32
    (<= 0: off), seeds int64, offsets int64. Semantics: pagedkern.reference.sampling; the CUDA
    kernel draws from exactly that distribution (not necessarily the same ids)."""
    lv = view(logits, "logits")
    check_dtype(lv, FLOAT_DTYPES)
    check_ndim(lv, 2)
    rows, vocab = lv.shape
    if vocab == 0:
        raise ValueError(f"{lv.describe()}: the vocabulary is empty")
    if vocab > 1 and lv.strides[1] != 1:
        raise ValueError(f"{lv.describe()}: rows must be contiguous, got strides {lv.strides}")
    views = [lv]
    values = (temperature, top_p, top_k, seeds, offsets)
    arrays: dict[str, object] = {}
    for (name, dtype), value in zip(_PARAMS, values, strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            pv = view(value, name)
            check_dtype(pv, (dtype,))
            check_shape(pv, (rows,))
            check_contiguous(pv)
            views.append(pv)
            arrays[name] = pv
        elif dtype.startswith("int") and not isinstance(value, int):
            raise TypeError(f"{name} must be an int or an {dtype} array, got {value!r}")
    if out is not None:
        ov = view(out, "out")
        check_dtype(ov, ("int32",))
        check_shape(ov, (rows,))
        check_contiguous(ov)
        views.append(ov)
    common_device(views)
    if not kernel_or_reference("sample", views, support.sample(lv.dtype, vocab)):
        reference = reference_on_torch("sample", views)
        return reference.sample(logits, temperature, top_p, top_k, seeds, offsets, out)
    if rows == 0:
        return out if out is not None else empty_like(lv, (0,), "int32")
    module, device, handle = launch_context(views, stream)
    for (name, dtype), value in zip(_PARAMS, values, strict=True):
        if name not in arrays:
            if name == "top_k":  # k >= vocab is "off" as much as k = 2^31 - 1
                value = min(max(value, _INT32[0]), _INT32[1])
            arrays[name] = view(full_like(lv, (rows,), value, dtype), name)
    if out is None:
        out = empty_like(lv, (rows,), "int32")
        ov = view(out, "out")
    module.sample(
        out=ov.ptr,
        logits=lv.ptr,
        temperature=arrays["temperature"].ptr,
        top_p=arrays["top_p"].ptr,
        top_k=arrays["top_k"].ptr,
        seeds=arrays["seeds"].ptr,
        offsets=arrays["offsets"].ptr,
        rows=rows,
        vocab=vocab,
        logits_stride=lv.strides[0],
        dtype=DTYPE_CODES[lv.dtype],
        device=device,
        stream=handle,
    )
    return out
