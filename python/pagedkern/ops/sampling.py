"""sample: validation, then the reference (the fused CUDA kernel lands with the decode issue)."""

from __future__ import annotations

from .arrays import FLOAT_DTYPES, check_dtype, check_ndim, check_shape, common_device, view
from .launch import reference_on_torch

_PARAMS = (
    ("temperature", "float32"),
    ("top_p", "float32"),
    ("top_k", "int32"),
    ("seeds", "int64"),
    ("offsets", "int64"),
)


def sample(logits, temperature, top_p, top_k, seeds, offsets=0, out=None, *, stream=None):
    """One token id per row of logits [B, V] (int32 [B]). Per-row parameters, as [B] arrays or
    Python numbers: temperature float32 (<= 0: greedy), top_p float32 (>= 1: off), top_k int32
    (<= 0: off), seeds int64, offsets int64. Semantics: pagedkern.reference.sampling."""
    lv = view(logits, "logits")
    check_dtype(lv, FLOAT_DTYPES)
    check_ndim(lv, 2)
    rows, vocab = lv.shape
    if vocab == 0:
        raise ValueError(f"{lv.describe()}: the vocabulary is empty")
    views = [lv]
    values = (temperature, top_p, top_k, seeds, offsets)
    for (name, dtype), value in zip(_PARAMS, values, strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            pv = view(value, name)
            check_dtype(pv, (dtype,))
            check_shape(pv, (rows,))
            views.append(pv)
        elif dtype.startswith("int") and not isinstance(value, int):
            raise TypeError(f"{name} must be an int or an {dtype} array, got {value!r}")
    if out is not None:
        ov = view(out, "out")
        check_dtype(ov, ("int32",))
        check_shape(ov, (rows,))
        views.append(ov)
    common_device(views)
    reference = reference_on_torch("sample", views)
    return reference.sample(logits, temperature, top_p, top_k, seeds, offsets, out)
