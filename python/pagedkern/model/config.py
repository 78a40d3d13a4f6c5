"""ModelConfig: the shape of a Llama-family model, its presets, and the HF config.json reader."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE. rope_type "linear": every frequency / factor; "llama3":
    Llama 3.1's piecewise scaling (low frequencies / factor, high ones kept, smooth between);
    "yarn": YaRN (frequencies blended between kept and / factor by a ramp over the dimensions
    that beta_fast / beta_slow bound, cos and sin times attention_factor; gpt-oss)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions
    attention_factor: float | None = None  # yarn: None = 0.1 * ln(factor) + 1


SLIDING, FULL = "sliding", "full"  # layer_types entries
ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Llama-family decoder: RMSNorm, GQA attention with rotate-half RoPE, SwiGLU MLP.

    Covers Llama 2/3, Qwen2-style (q/k/v bias), Qwen3 (QK-norm: an RMSNorm over each query
    and key head before RoPE), SmolLM2 (tied embeddings) and Gemma 2 / Gemma 3 text: GeGLU,
    sandwich norms (the attention and MLP outputs normed before their residual adds),
    embeddings scaled by sqrt(hidden), an attention scale of its own, logit soft-caps,
    sliding-window layers (with their own RoPE base in Gemma 3). Gemma's checkpoints store
    norm weights w for a scale of (1 + w): the loaders hand the model 1 + w.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets qkv_bias and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k (weights [head_dim]) before RoPE
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # Gemma 2/3: norms of the attention and MLP outputs too
    embed_scale: float | None = None  # embeddings times this, in the activation dtype (Gemma)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    final_soft_cap: float | None = None  # cap * tanh(logit / cap) (Gemma 2)
    sliding_window: int | None = None  # keys visible to the query at p: p - k < window
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () = every layer FULL
    rope_local_theta: float | None = None  # RoPE base of SLIDING layers, unscaled (Gemma 3)
    # QK-norm over the whole q / k projection (weights [Hq*D], [Hkv*D]) instead of per head
    qk_norm_whole: bool = False  # (OLMoE)
    # Mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE): num_experts > 0 makes every layer's MLP
    # a router over num_experts gated MLPs of moe_intermediate_size, top num_experts_per_tok of
    # them per token, except the dense_layers (plain MLPs of intermediate_size). A shared expert
    # (Qwen2-MoE: a dense MLP of shared_expert_size, gated by a sigmoid) adds to the experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k weights divided by their sum
    dense_layers: tuple[int, ...] = ()
    shared_expert_size: int = 0
    # gpt-oss: a learned sink logit per query head, a router bias, routing weights softmaxed
    # over the selected top-k ("softmax_topk"), expert biases and the clamped SwiGLU
    # (swiglu_limit not None: gate clamped above, up to [-limit, limit], (up + 1) * gate *
    # sigmoid(alpha * gate))
    attn_sinks: bool = False
    router_bias: bool = False
    moe_scoring: str = "softmax"  # "softmax", "sigmoid", "softmax_topk"
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        sizes = (self.vocab_size, self.hidden_size, self.intermediate_size, self.num_layers)
        if min(sizes) <= 0 or min(self.num_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"{self.name}: every size must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim {self.head_dim} must be even for RoPE")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{self.name}: hidden_act {self.hidden_act!r} not in {ACTIVATIONS}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # (JSON gives lists)
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}
        ):
            raise ValueError(
                f"{self.name}: layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                f"{self.num_layers} layers, got {self.layer_types}"
            )
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"{self.name}: num_experts_per_tok {self.num_experts_per_tok} must be in "
                    f"[1, num_experts {self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0 or self.shared_expert_size < 0:
                raise ValueError(f"{self.name}: expert sizes must be positive")
            if any(not 0 <= i < self.num_layers for i in self.dense_layers):
                raise ValueError(f"{self.name}: dense_layers {self.dense_layers} out of range")
        if self.moe_scoring not in ("softmax", "sigmoid", "softmax_topk"):
            raise ValueError(f"{self.name}: unknown moe_scoring {self.moe_scoring!r}")
        if self.swiglu_limit is not None and not 0 < self.swiglu_limit < math.inf:
            raise ValueError(f"{self.name}: swiglu_limit must be positive and finite")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError(f"{self.name}: sliding layers need a sliding_window")
        for key, value in (
            ("sliding_window", self.sliding_window),
            ("attn_logit_softcapping", self.attn_soft_cap),
            ("final_logit_softcapping", self.final_soft_cap),
            ("query_pre_attn_scalar", self.attn_scale),
            ("embed_scale", self.embed_scale),
        ):
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{self.name}: {key} must be positive and finite, got {value}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for a full-attention layer."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def attention_options(self) -> dict:
        """The attention options some layer uses (ops.support.attention_options' keywords)."""
        return {
            "sliding_window": self.sliding_window if SLIDING in self.layer_types else None,
            "soft_cap": self.attn_soft_cap,
            "sinks": True if self.attn_sinks else None,
        }

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: q rows, then k rows, then v rows."""
        return self.q_size + 2 * self.kv_size

    def num_parameters(self, active: bool = False) -> int:
        """The model's parameters (biases aside); active: those one token's forward reads, its
        top-k routed experts rather than all of them (the cost of a token in an MoE model)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        if self.qk_norm_whole:
            norms += self.q_size + self.kv_size - 2 * self.head_dim
        layer = h * self.qkv_size + self.q_size * h + 3 * h * i + norms
        head = 0 if self.tie_word_embeddings else v * h
        total = v * h + self.num_layers * layer + h + head
        if self.num_experts:  # MoE layers: the router, experts and shared expert, not 3HI
            e, s = self.num_experts, self.shared_expert_size
            routed = self.num_experts_per_tok if active else e
            moe = e * h + routed * 3 * h * self.moe_intermediate_size + (3 * h * s + h if s else 0)
            total += (self.num_layers - len(self.dense_layers)) * (moe - 3 * h * i)
        return total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # A few MB: fast enough for every CPU test.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    ),
    # The reference document's model (an ~8B Llama-3-like shape), for benchmarks at scale.
    "seed": ModelConfig(
        name="seed",
        vocab_size=100000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    # The default model's shape, for synthetic runs without the GGUF file.
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # Gemma shapes (Gemma 3 1B, Gemma 2 2B), for synthetic runs of their features at scale.
    "gemma3-1b": ModelConfig(
        name="gemma3-1b",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qk_norm=True,
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        embed_scale=1152**0.5,
        attn_scale=256**-0.5,
        sliding_window=512,
        layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)),
        rope_local_theta=10000.0,
    ),
    "gemma2-2b": ModelConfig(
        name="gemma2-2b",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_layers=26,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        embed_scale=2304**0.5,
        attn_scale=256**-0.5,
        attn_soft_cap=50.0,
        final_soft_cap=30.0,
        sliding_window=4096,
        layer_types=tuple(FULL if (i + 1) % 2 == 0 else SLIDING for i in range(26)),
    ),
    # Qwen3-30B-A3B's shape (128 experts, top-8), for synthetic runs of the MoE path at scale.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}

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


def _rope_scaling_from_hf(raw: dict | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
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
    layer_types names (by default those from max_window_layers on); Llama has none (a
    sliding_window in its config is refused, not ignored)."""
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    layers = int(raw["num_hidden_layers"])
    qwen = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    qwen_archs = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"}
    if model_type in qwen or (qwen_archs | {"Qwen3MoeForCausalLM"}) & set(archs):
        if not raw.get("use_sliding_window"):
            return {}
        window = _positive(raw, "sliding_window", source, int)
        types = raw.get("layer_types")
        if types is None:
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
    if experts == 0:  # (a Qwen MoE config with no experts: a dense model)
        fields.update(num_experts=0, num_experts_per_tok=0, dense_layers=())
    return fields


def _config_from_hf(
    raw: dict[str, Any], source: str, gemma: str | None, moe: str | None = None
) -> ModelConfig:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
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
