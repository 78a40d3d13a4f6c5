"""The HF config.json reader: a checkpoint's config as a ModelConfig, naming the key it refuses."""

from __future__ import annotations

import math
from typing import Any

from .config import FULL, SLIDING, ModelConfig, RopeScaling
from .config_checks import check_types
from .errors import ModelLoadError

# model_type values whose checkpoints are plain Llama-family decoders.
_HF_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
_HF_ARCHITECTURES = {
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
}
# Gemma's text decoders: model_type -> its CausalLM class and local:global layer pattern
# Mixtures of experts: model_type -> its CausalLM class
_MOE = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
_MOE_ARCHITECTURES = {arch: model_type for model_type, arch in _MOE.items()}
_GEMMA = {"gemma2": ("Gemma2ForCausalLM", 2), "gemma3_text": ("Gemma3ForCausalLM", 6)}
_GEMMA_ARCHITECTURES = {arch: model_type for model_type, (arch, _) in _GEMMA.items()}
_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}
# The types of the config.json keys the reader takes (config_checks)
_KINDS = dict.fromkeys(
    ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
     "moe_intermediate_size", "decoder_sparse_step"),
    "size",
)  # fmt: skip
_KINDS |= dict.fromkeys(
    ("num_local_experts", "num_experts", "num_experts_per_tok", "max_window_layers",
     "shared_expert_intermediate_size", "sliding_window", "sliding_window_pattern"),
    "count",
)  # fmt: skip
_KINDS |= dict.fromkeys(
    ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
     "attn_logit_softcapping", "final_logit_softcapping", "swiglu_limit", "swiglu_alpha"),
    "number",
)  # fmt: skip
_KINDS |= dict.fromkeys(
    ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "qkv_bias",
     "use_sliding_window", "use_bidirectional_attention"),
    "bool",
)  # fmt: skip
_KINDS |= dict.fromkeys(("model_type", "hidden_act", "hidden_activation", "_name_or_path"), "str")
_KINDS |= {"rope_scaling": "dict", "rope_parameters": "dict", "architectures": "strs"}
_KINDS |= {"layer_types": "strs", "mlp_only_layers": "ints"}
_ROPE_KINDS = dict.fromkeys(
    ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
     "attention_factor", "mscale", "mscale_all_dim", "rope_theta"),
    "number",
)  # fmt: skip
_ROPE_KINDS |= {"original_max_position_embeddings": "size", "truncate": "bool"}
_ROPE_KINDS |= {"rope_type": "str", "type": "str"}


def _rope_scaling_from_hf(raw: dict | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(source, f"rope_scaling must be a JSON object, got {raw!r}")
    check_types(raw, _ROPE_KINDS, source, label="rope_scaling.")
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "yarn":  # transformers' defaults; truncate as it reads it (absent: True)
        attention_factor = raw.get("attention_factor")
        if raw.get("mscale") or raw.get("mscale_all_dim"):
            raise ModelLoadError(source, "unsupported: yarn mscale / mscale_all_dim")
        return RopeScaling(
            "yarn",
            float(raw["factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            truncate=bool(raw.get("truncate", True)),
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
    raise ModelLoadError(source, f"unsupported rope scaling type {rope_type!r}")


def _positive(raw: dict[str, Any], key: str, source: str, kind=float):
    """raw[key] as a positive `kind`, None if absent or null; else a ModelLoadError naming key."""
    value = raw.get(key)
    if value is None:
        return None
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok or not 0 < value < math.inf:
        raise ModelLoadError(source, f"{key} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def _gemma_fields(raw: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 2 / Gemma 3 text config beyond the Llama ones."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(source, f"unsupported hidden_activation {act!r}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(source, "unsupported: use_bidirectional_attention")
    hidden, layers = int(raw["hidden_size"]), int(raw["num_hidden_layers"])
    window = _positive(raw, "sliding_window", source, int)
    types = raw.get("layer_types")
    if types is None:  # older configs: every pattern-th layer global, the others local
        pattern = int(raw.get("sliding_window_pattern") or _GEMMA[model_type][1])
        kinds = ("sliding_attention", "full_attention")
        types = [kinds[(i + 1) % pattern == 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - set(_LAYER_TYPES):
        raise ModelLoadError(
            source, "layer_types must list 'sliding_attention' or 'full_attention' per layer"
        )
    layer_types = tuple(_LAYER_TYPES[t] for t in types) if window is not None else ()
    # Gemma 3 keeps a RoPE per layer kind: the global one may be scaled, the local one is not
    rope = raw.get("rope_parameters") or {}
    if model_type == "gemma3_text":
        if "full_attention" in rope or "sliding_attention" in rope:  # transformers v5
            full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        else:
            full = {**rope, **(raw.get("rope_scaling") or {})}
            local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        if _rope_scaling_from_hf(local, source) is not None:
            raise ModelLoadError(source, "unsupported: rope scaling on the sliding layers")
        rope_fields = dict(
            rope_theta=float(raw.get("rope_theta", full.get("rope_theta", 1e6))),
            rope_scaling=_rope_scaling_from_hf(full, source),
            rope_local_theta=float(local.get("rope_theta", 10000.0)),
        )
        attn_cap = None  # Gemma 3 has none (transformers ignores attn_logit_softcapping)
    else:
        rope_fields = {}
        attn_cap = _positive(raw, "attn_logit_softcapping", source)
    scalar = _positive(raw, "query_pre_attn_scalar", source) or 256.0
    return dict(
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        attn_scale=scalar**-0.5,
        attn_soft_cap=attn_cap,
        final_soft_cap=_positive(raw, "final_logit_softcapping", source),
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=model_type == "gemma3_text",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        **rope_fields,
    )


def _llama_windows(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Sliding windows of the Llama family as transformers applies them: Mistral's
    sliding_window on every layer; Qwen2 / Qwen3's only with use_sliding_window, on the layers
    layer_types names (by default those from max_window_layers on); Qwen3-MoE's with
    use_sliding_window on every layer; Llama has none (a sliding_window in its config is
    refused, not ignored)."""
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    layers = int(raw["num_hidden_layers"])
    qwen = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    qwen_archs = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"}
    if model_type in qwen or (qwen_archs | {"Qwen3MoeForCausalLM"}) & set(archs):
        if not raw.get("use_sliding_window"):
            return {}
        window = _positive(raw, "sliding_window", source, int)
        types = raw.get("layer_types")
        if model_type == "qwen3_moe" or (model_type is None and "Qwen3MoeForCausalLM" in archs):
            # Qwen3-MoE's attention windows every layer: transformers reads neither
            # layer_types nor max_window_layers for it
            types = ["sliding_attention"] * layers
        elif types is None and (model_type == "qwen2_moe" or "Qwen2MoeForCausalLM" in archs):
            # transformers v5 windows every other layer below max_window_layers, v4 those from
            # it on (and only under flash attention): no layer set both agree on
            raise ModelLoadError(
                source, "unsupported: use_sliding_window in a Qwen2-MoE config without layer_types"
            )
        elif types is None:
            first = int(raw.get("max_window_layers", 28))
            types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    elif model_type == "gpt_oss" or "GptOssForCausalLM" in archs:  # alternating by default
        window = _positive(raw, "sliding_window", source, int)
        kinds = ("sliding_attention", "full_attention")
        types = raw.get("layer_types") or [kinds[i % 2] for i in range(layers)]
    elif model_type in ("mistral", "mixtral") or {"MistralForCausalLM", "MixtralForCausalLM"} & set(
        archs
    ):
        window = _positive(raw, "sliding_window", source, int)
        types = ["sliding_attention"] * layers
    else:
        if raw.get("sliding_window"):
            raise ModelLoadError(
                source, f"unsupported: sliding_window in a {model_type or 'Llama'} config"
            )
        return {}
    if not isinstance(types, list) or len(types) != layers or set(types) - set(_LAYER_TYPES):
        raise ModelLoadError(
            source, "layer_types must list 'sliding_attention' or 'full_attention' per layer"
        )
    if window is None or "sliding_attention" not in types:
        return {}
    return dict(sliding_window=window, layer_types=tuple(_LAYER_TYPES[t] for t in types))


def hf_norm_offset(raw: dict[str, Any]) -> float:
    """What the HF checkpoint's norm weights lack: 1 for Gemma's (it scales by 1 + w)."""
    archs = raw.get("architectures") or []
    gemma = raw.get("model_type") in _GEMMA or any(a in _GEMMA_ARCHITECTURES for a in archs)
    return 1.0 if gemma else 0.0


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig from a HF config.json dict; ModelLoadError naming `source` if unsupported."""
    check_types(raw, _KINDS, source)
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    gemma = model_type if model_type in _GEMMA else None
    if gemma is None and model_type is None:
        gemma = next((_GEMMA_ARCHITECTURES[a] for a in archs if a in _GEMMA_ARCHITECTURES), None)
    if model_type == "gemma3":
        raise ModelLoadError(
            source,
            "unsupported architecture 'gemma3' (multimodal Gemma 3; its text-only model, "
            "model_type gemma3_text / Gemma3ForCausalLM, is supported)",
        )
    if gemma is not None:
        return _config_from_hf(raw, source, gemma)
    moe = model_type if model_type in _MOE else None
    if moe is None and model_type is None:
        moe = next((_MOE_ARCHITECTURES[a] for a in archs if a in _MOE_ARCHITECTURES), None)
    if moe is not None:
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(source, f"unsupported activation {raw['hidden_act']!r}")
        return _config_from_hf(raw, source, None, moe)
    if model_type not in _HF_MODEL_TYPES and not set(archs) & _HF_ARCHITECTURES:
        what = model_type or ", ".join(archs) or "no model_type"
        raise ModelLoadError(
            source,
            f"unsupported architecture {what!r} (supported: Llama, Qwen2, Qwen3, Mistral-style "
            "decoders, Gemma 2, Gemma 3 text, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss)",
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(source, f"unsupported activation {raw['hidden_act']!r}")
    return _config_from_hf(raw, source, None)


def _moe_fields(raw: dict[str, Any], moe: str, source: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts config beyond the Llama ones, placed as
    transformers builds the layers: Qwen's MoE layers are those not in mlp_only_layers whose
    (index + 1) is a multiple of decoder_sparse_step, the others dense MLPs of
    intermediate_size; Mixtral's and OLMoE's experts have intermediate_size each."""
    layers = int(raw["num_hidden_layers"])
    # (transformers v5 writes every model's count as num_local_experts, older ones num_experts)
    count = raw.get("num_local_experts", raw.get("num_experts"))
    if count is None:
        raise ModelLoadError(source, "config.json lacks 'num_local_experts' / 'num_experts'")
    experts = int(count)
    fields: dict[str, Any] = dict(
        num_experts=experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        norm_topk_prob=True if moe == "mixtral" else bool(raw.get("norm_topk_prob", False)),
    )
    if moe in ("qwen2_moe", "qwen3_moe"):
        step = int(raw.get("decoder_sparse_step", 1))
        only = raw.get("mlp_only_layers") or []
        if step <= 0 or not isinstance(only, list):
            raise ModelLoadError(source, "invalid decoder_sparse_step / mlp_only_layers")
        fields["dense_layers"] = tuple(
            i for i in range(layers) if i in only or experts == 0 or (i + 1) % step
        )
        fields["moe_intermediate_size"] = int(raw["moe_intermediate_size"])
        if moe == "qwen2_moe":
            fields["shared_expert_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
            fields["qkv_bias"] = bool(raw.get("qkv_bias", True))
        else:
            fields["qk_norm"] = True
    else:
        fields["moe_intermediate_size"] = int(raw["intermediate_size"])
    if moe == "gpt_oss":
        from .gpt_oss import gpt_oss_fields

        fields.update(gpt_oss_fields(raw, source))
    if moe == "olmoe":
        if raw.get("clip_qkv") is not None:
            raise ModelLoadError(source, "unsupported: clip_qkv in an OLMoE config")
        fields.update(qk_norm=True, qk_norm_whole=True)
    if experts == 0 or len(fields.get("dense_layers", ())) == layers:
        # (a Qwen MoE config with no experts, or with decoder_sparse_step / mlp_only_layers
        # making every layer a plain MLP: a dense model, with no expert tensors to find)
        fields.update(num_experts=0, num_experts_per_tok=0, dense_layers=())
    return fields


def _config_from_hf(
    raw: dict[str, Any], source: str, gemma: str | None, moe: str | None = None
) -> ModelConfig:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        if raw.get(key) is None:  # (absent or null)
            raise ModelLoadError(source, f"config.json lacks {key!r}")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = raw.get("rope_parameters") or {}  # transformers v5 spelling
        attention_bias = bool(raw.get("attention_bias", False))
        fields = dict(
            name=raw.get("_name_or_path") or model_type or "hf",
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling_from_hf(raw.get("rope_scaling") or rope, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3" or "Qwen3ForCausalLM" in archs,
        )
        if gemma is not None:
            fields.update(_gemma_fields(raw, gemma, source))
        else:
            fields.update(_llama_windows(raw, source))
        if moe is not None:
            fields.update(_moe_fields(raw, moe, source))
        return ModelConfig(**fields)
    except KeyError as exc:
        raise ModelLoadError(source, f"config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(source, f"invalid config.json: {exc}") from None
