"""The quantized-experts MoE check shared by the emulated tests (test_moe_quant_emulated.py) and
the GPU tests (test_moe_quant_gpu.py): fresh random experts quantized to int4 / int8, and the
float reference over the weights the kernel multiplies (int4: round_T(q * scale_T + min_T), as
int4_dequant.cuh computes them; int8: q * scale, the scale applied to the fp32 sum)."""

from __future__ import annotations

import torch

from pagedkern import reference
from pagedkern.model.quantized_linear import quantize_experts
from pagedkern.reference.quantized_weight import QuantizedWeight


def quantized_operands(tokens, experts, hidden, inter, dtype, fmt, group, seed, device="cpu"):
    """(x, logits, w_gate_up, w_down): x and logits in dtype / fp32, the experts quantized."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g) * 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    qgu = quantize_experts(gate_up, fmt, group)
    qd = quantize_experts(down, fmt, group)
    return x.to(device), logits.to(device), qgu.to(device), qd.to(device)


def kernel_weights(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] in dtype: int4 round(q * scale + min) with scale and min rounded to dtype
    first (fp32 products are exact, one rounding); int8 q * scale rounded once."""
    if w.format == "int8":
        return (w.qweight.double() * w.scales.double()[..., None]).to(dtype)
    e, n, k = w.shape
    g = w.group_size
    q = w.unpacked_int4().float().view(e, n, k // g, g)
    s = w.scales.to(dtype).float()[..., None]
    m = w.mins.to(dtype).float()[..., None]
    return (q * s + m).to(dtype).view(e, n, k)


def expected(x, logits, w_gate_up, w_down, top_k, **options) -> torch.Tensor:
    """reference.fused_moe over the weights the kernel multiplies."""
    dtype = x.dtype
    return reference.fused_moe(x, logits, kernel_weights(w_gate_up, dtype),
                               kernel_weights(w_down, dtype), top_k, **options)  # fmt: skip
