"""The mixture-of-experts MLP of a decoder layer (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss): the
router GEMM in the activation dtype (with gpt-oss's bias, as transformers computes it), then
ops.fused_moe over the layer's stacked experts (gpt-oss: their biases, the clamped SwiGLU, the
softmax over the top-k), plus Qwen2-MoE's shared expert scaled by its sigmoid gate; under expert
parallelism the routed experts go through the group's dispatch and combine instead."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ops
from .collectives import SINGLE, Collectives
from .config import ModelConfig
from .weights import LayerWeights


def moe_mlp(
    h: torch.Tensor,
    layer: LayerWeights,
    config: ModelConfig,
    linear: Callable[..., torch.Tensor],
    tp: Collectives = SINGLE,
) -> torch.Tensor:
    """[T, H] MLP output of a MoE layer for its normed input h [T, H]; `linear` is the model's
    GEMM (llama.linear). Expert parallel (tp.expert_parallel): the layer holds this rank's
    experts whole, and tp.routed_experts dispatches the tokens to theirs; the output is then
    this rank's share, which the model's all-reduce after the MLP completes."""
    logits = linear(h, layer.router, layer.router_bias)
    gpt_oss = {}
    if config.swiglu_limit is not None:
        gpt_oss = dict(
            activation="clamped_swiglu",
            swiglu_alpha=config.swiglu_alpha,
            swiglu_limit=config.swiglu_limit,
        )
    experts = ops.fused_moe if not tp.expert_parallel else tp.routed_experts
    out = experts(
        h,
        logits,
        layer.experts_gate_up,
        layer.experts_down,
        config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        scoring=config.moe_scoring,
        w_gate_up_bias=layer.experts_gate_up_bias,
        w_down_bias=layer.experts_down_bias,
        **({"activation": config.hidden_act} | gpt_oss),
    )
    if layer.gate_up is not None:  # the shared expert, which every token goes through
        shared = linear(ops.silu_and_mul(linear(h, layer.gate_up)), layer.down)
        gate = torch.sigmoid(linear(h, layer.shared_gate))
        out = out + gate * shared
    return out
