"""The checkpoint tensors a model config expects, under HF names (every loader maps its format
onto them), with their shapes; and Mixtral's own names of the MoE tensors."""

from __future__ import annotations

from .config import ModelConfig
from .gpt_oss import gpt_oss_moe_shapes

# HF names of a layer's norms: (input_norm, post_norm, attn_out_norm, mlp_out_norm)
_NORMS = ("input_layernorm", "post_attention_layernorm", None, None)
_SANDWICH_NORMS = (
    "input_layernorm",
    "pre_feedforward_layernorm",
    "post_attention_layernorm",
    "post_feedforward_layernorm",
)


def layer_norm_names(config: ModelConfig) -> tuple[str | None, ...]:
    """HF names of a layer's (input_norm, post_norm, attn_out_norm, mlp_out_norm) weights."""
    return _SANDWICH_NORMS if config.sandwich_norms else _NORMS


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor (HF names) with its shape; biases only where the config has them."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        for norm in layer_norm_names(config):
            if norm is not None:
                shapes[p + norm + ".weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, h)
            if config.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.attn_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_heads,)
        if config.is_moe_layer(n) and config.expert_bias:
            e, i = config.num_experts, config.moe_intermediate_size
            shapes.update(gpt_oss_moe_shapes(p, e, h, i))
        elif config.is_moe_layer(n):
            shapes.update(_moe_shapes(config, p))
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        if config.mlp_bias:
            for name, rows in (("gate_proj", i), ("up_proj", i), ("down_proj", h)):
                shapes[p + f"mlp.{name}.bias"] = (rows,)
        if config.qk_norm:
            whole = config.qk_norm_whole
            shapes[p + "self_attn.q_norm.weight"] = (q if whole else config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv if whole else config.head_dim,)
    return shapes


def _moe_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's tensors under Qwen-MoE / OLMoE names (Mixtral's are aliases of these,
    mixtral_name): the router, each expert's gate/up/down, the shared expert and its gate."""
    h, i, s = config.hidden_size, config.moe_intermediate_size, config.shared_expert_size
    shapes = {p + "mlp.gate.weight": (config.num_experts, h)}
    for e in range(config.num_experts):
        x = f"{p}mlp.experts.{e}."
        shapes.update({x + "gate_proj.weight": (i, h), x + "up_proj.weight": (i, h)})
        shapes[x + "down_proj.weight"] = (h, i)
    if s:
        x = p + "mlp.shared_expert."
        shapes.update({x + "gate_proj.weight": (s, h), x + "up_proj.weight": (s, h)})
        shapes[x + "down_proj.weight"] = (h, s)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_name(name: str) -> str | None:
    """Mixtral's checkpoint name of a MoE tensor named as _moe_shapes names it, else None:
    block_sparse_moe.gate (the router) and block_sparse_moe.experts.<e>.w1 / w3 / w2."""
    if ".mlp.gate." in name:
        return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if ".mlp.experts." not in name:
        return None
    head, _, tail = name.partition(".mlp.experts.")
    e, proj, rest = tail.split(".", 2)
    return f"{head}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT[proj]}.{rest}"
