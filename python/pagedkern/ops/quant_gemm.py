"""quant_linear: x @ W.T for a weight-only quantized W (int8 per channel, int4 per group).

Dispatch after validation: CPU tensors -> torch's maintained int-pack kernels
(aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu), which want bf16 activations and
bf16 scales, so x is rounded to bf16 around the GEMM and the result returned in x's dtype;
CUDA tensors -> csrc/quant_gemm.cu for decode-shaped M, else (and with the 'reference' backend)
a bf16 dequantized weight and torch.matmul. The float64 ground truth is
pagedkern.reference.quant_gemm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.quantized_linear import QuantizedWeight


def _check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
        what = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D float tensor [M, K], got {what}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}: K must equal the weight's {weight.shape[1]}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def _cpu_packed(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, bf16 scales[/zeros]) for the CPU kernels, built once per weight."""
    packed = weight.packed.get("cpu")
    if packed is None:
        if weight.format == "int8":
            if weight.qweight.data_ptr() % 64:  # the int8 kernel crashes on unaligned weights
                weight.qweight = weight.qweight.clone()  # (e.g. views into a safetensors file)
            packed = (weight.qweight, weight.scales.to(torch.bfloat16))
        else:  # the packing wants N % 16 == 0: pad with zero rows, sliced off the output
            pad = -weight.shape[0] % 16
            q = F.pad(weight.unpacked_int4().to(torch.int32), (0, 0, 0, pad))
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
            zeros = weight.mins.float() + 8 * weight.scales.float()  # w = (q - 8) * s + zero
            sz = F.pad(torch.stack([weight.scales.float(), zeros], dim=-1), (0, 0, 0, 0, 0, pad))
            packed = (w, sz.transpose(0, 1).contiguous().to(torch.bfloat16))  # [K/G, N, 2]
        weight.packed["cpu"] = packed
    return packed


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float -> [M, N] in x.dtype (accumulation in fp32 or wider)."""
    _check(x, weight, bias)
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if x.device.type == "cpu":
        w, scales = _cpu_packed(weight)
        xb = x.to(torch.bfloat16).contiguous()
        if weight.format == "int8":
            out = torch.ops.aten._weight_int8pack_mm(xb, w, scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, weight.group_size, scales)
            out = out[:, : weight.shape[0]]
    else:
        out = _cuda(x, weight)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


def _cuda(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    dense = weight.packed.get("dense")
    if dense is None:  # prefill-shaped fallback: a bf16 copy of the weight, made once
        dense = weight.dequantize_rows(dtype=torch.bfloat16)
        weight.packed["dense"] = dense
    return x.to(torch.bfloat16) @ dense.T
