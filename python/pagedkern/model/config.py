"""ModelConfig: the shape of a Llama-family model, its presets, and the HF config.json reader."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE. rope_type "linear": every frequency / factor; "llama3":
    Llama 3.1's piecewise scaling (low frequencies / factor, high ones kept, smooth between)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Llama-family decoder: RMSNorm, GQA attention with rotate-half RoPE, SwiGLU MLP.

    Covers Llama 2/3, Qwen2-style (q/k/v bias), Qwen3 (QK-norm: an RMSNorm over each query
    and key head before RoPE) and SmolLM2 (tied embeddings).
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

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = h * self.qkv_size + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

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
}

# model_type values whose checkpoints are plain Llama-family decoders.
_HF_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
_HF_ARCHITECTURES = {
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
}


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
    raise ModelLoadError(source, f"unsupported rope scaling type {rope_type!r}")


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig from a HF config.json dict; ModelLoadError naming `source` if unsupported."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in _HF_MODEL_TYPES and not set(archs) & _HF_ARCHITECTURES:
        what = model_type or ", ".join(archs) or "no model_type"
        raise ModelLoadError(
            source,
            f"unsupported architecture {what!r} (supported: Llama, Qwen2, Qwen3, Mistral-style "
            "decoders)",
        )
    # Qwen configs carry a sliding_window that only applies with use_sliding_window.
    qwen = model_type in ("qwen2", "qwen3")
    sliding = raw.get("use_sliding_window") if qwen else raw.get("sliding_window")
    if sliding:
        raise ModelLoadError(source, "unsupported: sliding-window attention")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(source, f"unsupported activation {raw['hidden_act']!r}")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = raw.get("rope_parameters") or {}  # transformers v5 spelling
        attention_bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
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
    except KeyError as exc:
        raise ModelLoadError(source, f"config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(source, f"invalid config.json: {exc}") from None
