"""GGUF tensor names: how llama.cpp names each tensor a model's HF checkpoint names (layers
"blk.<n>.", Gemma's sandwich norms, the MoE router and shared expert; each expert's weights a
slice of one stacked ffn_{gate,up,down}_exps tensor; gpt-oss's own in gguf_gpt_oss), and the
undoing of llama.cpp's Q/K row permutation for its interleaved RoPE."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .gguf_gpt_oss import gpt_oss_gguf_name

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma's sandwich norms (HF names as checkpoint_layout.layer_norm_names gives them)
_SANDWICH_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# A MoE layer's tensors (HF names as checkpoint_layout._moe_shapes gives them): the router,
# the shared expert and its gate; the experts' own are slices of one stacked tensor each
# (_EXPERT_NAMES)
_MOE_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    # (llama.cpp's converter stores it [1, H] (GGUF's [H, 1]); older files [H]: read [1, H])
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def expert_slice(hf_name: str) -> tuple[str, int] | None:
    """(GGUF name of the stacked [E, out, in] tensor, expert index) for one expert's weight,
    model.layers.3.mlp.experts.5.up_proj.weight -> (blk.3.ffn_up_exps.weight, 5), else None."""
    parts = hf_name.split(".")
    if len(parts) != 8 or parts[3:5] != ["mlp", "experts"] or parts[6] not in _EXPERT_NAMES:
        return None
    return f"blk.{parts[2]}.{_EXPERT_NAMES[parts[6]]}.{parts[7]}", int(parts[5])


def gguf_name(hf_name: str, sandwich: bool = False, gpt_oss: bool = False) -> str:
    """HF tensor name -> GGUF name: model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight
    (sandwich: Gemma's norm names; an expert's weight: its stacked tensor, "[e]" appended)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    if (stacked := expert_slice(hf_name)) is not None:
        return f"{stacked[0]}[{stacked[1]}]"
    if gpt_oss and (own := gpt_oss_gguf_name(hf_name)) is not None:
        return own
    _, _, layer, rest = hf_name.split(".", 3)
    if rest in _MOE_NAMES:
        return f"blk.{layer}.{_MOE_NAMES[rest]}"
    if sandwich and rest in _SANDWICH_NAMES:
        return f"blk.{layer}.{_SANDWICH_NAMES[rest]}"
    for hf, gg in _LAYER_NAMES.items():
        if rest.startswith(hf):
            return f"blk.{layer}.{gg}{rest[len(hf) :]}"
    raise KeyError(hf_name)


def holder(hf_name: str, config: ModelConfig) -> str:
    """The GGUF tensor holding an HF tensor (an expert's: its layer's stack)."""
    stacked = expert_slice(hf_name)
    return stacked[0] if stacked else gguf_name(hf_name, config.sandwich_norms, config.attn_sinks)


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: within each head, rows (2i, 2i+1) go back to
    (i, i + D/2). Works on weights [heads*D, in] and biases [heads*D]."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )
