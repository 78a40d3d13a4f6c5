"""The CPU backend's embedding lookup from a quantized table (an embedding tied to a quantized
LM head): csrc/cpu/dequantize_rows.h, QuantizedWeight.dequantize_rows's rows bit for bit in one
C++ call instead of its torch passes (gather, unpack, widen, scale, add)."""

from __future__ import annotations

import torch

from ...reference.quantized_weight import QuantizedWeight
from . import quant_gemv

_KEY = "cpu-dequantize-rows"  # weight.packed: the module's arguments for the weight, or None


def dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight.dequantize_rows(ids, dtype) for ids [T]: the C++ rows where they apply (one [N, K]
    weight of contiguous CPU parts, fp32 or fp16 scales, int32 ids, fp32 rows), else the
    reference's (wider ids too: narrowing one could wrap it onto a row)."""
    parts = weight.packed.get(_KEY, False)
    if parts is False:
        parts = weight.packed[_KEY] = _parts(weight)
    if (
        parts is None
        or dtype != torch.float32
        or ids.dim() != 1
        or ids.dtype != torch.int32
        or ids.device.type != "cpu"
    ):
        return weight.dequantize_rows(ids, dtype)  # (which checks the ids as the C++ does)
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], weight.shape[1])
    quant_gemv.cpu_module().dequantize_rows(
        *parts, ids.data_ptr(), ids.shape[0], out.data_ptr(), torch.get_num_threads()
    )
    return out


def _parts(weight: QuantizedWeight) -> tuple | None:
    """(int4, qweight, scales, mins, half_scales, n, k, group) as the module takes them, or None
    where the C++ rows do not apply."""
    if not quant_gemv.available() or weight.num_experts is not None:
        return None
    if weight.input_index is not None:  # (act-order: the reference puts the columns back)
        return None
    try:
        quant_gemv.check_parts(weight)
    except ValueError:
        return None
    scales, mins = weight.scales, weight.mins
    if scales.dtype not in (torch.float32, torch.float16) or not scales.is_contiguous():
        return None
    if mins is not None and (mins.dtype != scales.dtype or not mins.is_contiguous()):
        return None
    if not weight.qweight.is_contiguous() or (weight.group_size == 0 and mins is not None):
        return None  # (the reference reads no mins for a scale per row)
    n, k = weight.shape
    return (
        weight.format == "int4", weight.qweight.data_ptr(), scales.data_ptr(),
        0 if mins is None else mins.data_ptr(), scales.dtype == torch.float16, n, k,
        weight.group_size,
    )  # fmt: skip
