"""The mixture-of-experts MLP over weight-only quantized experts (stacked QuantizedWeights
[E, N, K], int4 or int8): by definition the float MLP (reference.fused_moe) over the dequantized
experts, computed in fp32 and returned in hidden's dtype. The CPU path (torch's int kernels,
bf16 activations) and the W4A16 / W8A16 kernels are compared with it."""

from __future__ import annotations

import torch

from .moe import fused_moe
from .quantized_weight import QuantizedWeight


def fused_moe_quantized(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: QuantizedWeight,
    w_down: QuantizedWeight,
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
    **options,
) -> torch.Tensor:
    """[T, H] in hidden's dtype; `options`: reference.fused_moe's (the expert biases,
    swiglu_alpha, swiglu_limit), biases taken in fp32."""
    options = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    out = fused_moe(
        hidden.float(),
        router_logits,
        w_gate_up.dequantize_rows(),
        w_down.dequantize_rows(),
        top_k,
        renormalize,
        activation,
        scoring,
        **options,
    )
    return out.to(hidden.dtype)
