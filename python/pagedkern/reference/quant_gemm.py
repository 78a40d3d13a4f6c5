"""Reference weight-only quantized GEMM: dequantize in float64, then matmul.

out = x @ dequantize(weight).T + bias, computed in float64 and returned in x's dtype. With
kernel_scales=torch.bfloat16 the scales (and int4 zero points, zero = min + 8 * scale, torch's
int4pack convention w = (q - 8) * scale + zero) are first rounded the way the CPU int-pack
kernels see them, so a kernel can be compared within fp32/bf16 output rounding alone.
"""

from __future__ import annotations

import torch

from .quantized_weight import QuantizedWeight


def dequantize(weight: QuantizedWeight, kernel_scales: torch.dtype | None = None) -> torch.Tensor:
    """The float64 [N, K] weight, its columns in the input's order (act-order's put back);
    kernel_scales: round scales/zeros to that dtype first."""
    return weight.in_input_order(_stored(weight, kernel_scales))


def _stored(weight: QuantizedWeight, kernel_scales: torch.dtype | None) -> torch.Tensor:
    """The float64 weight, its columns in the stored order."""
    n, k = weight.shape

    def rounded(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        return t if kernel_scales is None else t.to(kernel_scales).double()

    if weight.format == "int8":
        scales = rounded(weight.scales)
        if not weight.int8_per_group:
            return weight.qweight.double() * scales[:, None]
        g = weight.group_size
        w = weight.qweight.double() * scales.repeat_interleave(g, dim=1)
        return w if weight.mins is None else w + rounded(weight.mins).repeat_interleave(g, dim=1)
    g = weight.group_size
    q = weight.unpacked_int4().double().view(n, k // g, g)
    scale = weight.scales.double()
    if kernel_scales is None:
        w = q * scale[..., None] + weight.mins.double()[..., None]
    else:  # the zero point is formed in fp32 from the fp16 parts, then rounded
        zero = rounded(weight.mins.float() + 8 * weight.scales.float())
        w = (q - 8) * rounded(scale)[..., None] + zero[..., None]
    return w.view(n, k)


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    kernel_scales: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] float -> [M, N] in x.dtype."""
    out = x.double() @ dequantize(weight, kernel_scales).to(x.device).T
    if bias is not None:
        out += bias.double()
    return out.to(x.dtype)
