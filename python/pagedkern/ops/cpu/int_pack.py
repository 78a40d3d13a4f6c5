"""torch's int-pack CPU kernels for QuantizedWeight (aten._weight_int4pack_mm_for_cpu,
aten._weight_int8pack_mm: bf16 activations and scales): what ops.quant_linear runs on CPU tensors
under the reference backend, and the CPU backend without its C++ GEMM (pagedkern._cpu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...reference.quantized_weight import QuantizedWeight


def cpu_packed(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
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


def torch_int_pack_mm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ W.T by torch's int-pack CPU kernels: x rounded to bf16, bf16 [M, N] out. int8 with
    a scale per group (no torch kernel): the weight dequantized to bf16 and torch's GEMM."""
    if weight.int8_per_group:
        return x.to(torch.bfloat16) @ weight.dequantize_rows(dtype=torch.bfloat16).T
    w, scales = cpu_packed(weight)
    xb = weight.gathered(x).to(torch.bfloat16).contiguous()  # (act-order: the stored order)
    if weight.format == "int8":
        return torch.ops.aten._weight_int8pack_mm(xb, w, scales)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, weight.group_size, scales)
    return out[:, : weight.shape[0]]
