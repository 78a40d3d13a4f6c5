"""gpt-oss on the Llama-family forward: its config fields and its MoE checkpoint layout.

transformers' GptOssForCausalLM (models/gpt_oss/modeling_gpt_oss.py) is the reference:
- attention: q/k/v/o biases, a learned sink logit per query head (self_attn.sinks, joining
  every softmax and dropped from the output), sliding-window and full layers alternating
  (layer_types), YaRN RoPE on rotate-half pairs;
- router: mlp.router.weight [E, H] and .bias [E]; the top-k logits softmaxed among themselves;
- experts stacked: mlp.experts.gate_up_proj [E, H, 2I] (x @ W: columns gate 0, up 0, gate 1,
  up 1, ... interleaved) with gate_up_proj_bias [E, 2I] in the same order, down_proj
  [E, I, H] with down_proj_bias [E, H]; activation (up.clamp(-l, l) + 1) * g * sigmoid(a * g)
  with g = gate.clamp(max=l).
pagedkern's stacked layout (ops.fused_moe) is [E, 2I, H] gate rows then up rows and [E, H, I]:
the loader transposes and de-interleaves once at load. Released checkpoints store the expert
weights in MXFP4 (model/mxfp4.py, dequantized at load by the HF folder reader).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import ModelLoadError


def gpt_oss_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of a gpt-oss config beyond the Llama and MoE ones."""
    limit = raw.get("swiglu_limit", 7.0)
    alpha = raw.get("swiglu_alpha", 1.702)
    if not isinstance(limit, (int, float)) or not isinstance(alpha, (int, float)) or limit <= 0:
        raise ModelLoadError(source, f"invalid swiglu_limit / swiglu_alpha: {limit!r}, {alpha!r}")
    return dict(
        attn_sinks=True,
        router_bias=True,
        moe_scoring="softmax_topk",
        norm_topk_prob=False,  # (the top-k softmax sums to 1 already)
        expert_bias=True,
        swiglu_limit=float(limit),
        swiglu_alpha=float(alpha),
    )


def gpt_oss_moe_shapes(p: str, experts: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
    """A gpt-oss MoE layer's checkpoint tensors (prefix p = "model.layers.<n>.")."""
    x = p + "mlp.experts."
    return {
        p + "mlp.router.weight": (experts, h),
        p + "mlp.router.bias": (experts,),
        x + "gate_up_proj": (experts, h, 2 * i),
        x + "gate_up_proj_bias": (experts, 2 * i),
        x + "down_proj": (experts, i, h),
        x + "down_proj_bias": (experts, h),
    }


def gpt_oss_experts(
    p: str,
    load: Callable[[str], torch.Tensor],
    maybe: Callable[[str], torch.Tensor | None],
) -> dict[str, torch.Tensor | None]:
    """LayerWeights' router and expert fields of layer prefix p, in pagedkern's layout, from
    `load` (the checked, converted tensor of a HF name) and `maybe` (the same, None for one
    this rank does not hold: a tensor-parallel rank's down bias is rank 0's)."""
    x = p + "mlp.experts."
    gate_up = load(x + "gate_up_proj").transpose(1, 2)  # [E, 2I, H], rows interleaved
    bias = load(x + "gate_up_proj_bias")
    return dict(
        router=load(p + "mlp.router.weight"),
        router_bias=load(p + "mlp.router.bias"),
        experts_gate_up=torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous(),
        experts_gate_up_bias=torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1).contiguous(),
        experts_down=load(x + "down_proj").transpose(1, 2).contiguous(),
        experts_down_bias=maybe(x + "down_proj_bias"),
    )
