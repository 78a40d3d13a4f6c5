"""The mixture-of-experts MLP of a decoder layer (Mixtral, Qwen2/3-MoE, OLMoE): the router GEMM
in the activation dtype (as transformers computes it), then ops.fused_moe over the layer's
stacked experts, plus Qwen2-MoE's shared expert scaled by its sigmoid gate."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ops
from .config import ModelConfig
from .weights import LayerWeights


def moe_mlp(
    h: torch.Tensor,
    layer: LayerWeights,
    config: ModelConfig,
    linear: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """[T, H] MLP output of a MoE layer for its normed input h [T, H]; `linear` is the model's
    GEMM (llama.linear)."""
    logits = linear(h, layer.router)
    out = ops.fused_moe(
        h,
        logits,
        layer.experts_gate_up,
        layer.experts_down,
        config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        activation=config.hidden_act,
    )
    if layer.gate_up is not None:  # the shared expert, which every token goes through
        shared = linear(ops.silu_and_mul(linear(h, layer.gate_up)), layer.down)
        gate = torch.sigmoid(linear(h, layer.shared_gate))
        out = out + gate * shared
    return out
