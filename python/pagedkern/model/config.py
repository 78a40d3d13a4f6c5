"""ModelConfig: the shape of a Llama-family model, and its presets (`hf_config` reads config.json,
`gguf_config` a GGUF's metadata)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


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

    def __post_init__(self):
        # (a zero, negative or NaN factor or length gives infinite or NaN frequencies, or a
        # math domain error when the RoPE table is built)
        for key in ("factor", "low_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, key)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"rope_scaling {key} must be positive and finite, got {value}")
        if not self.high_freq_factor > self.low_freq_factor or math.isinf(self.high_freq_factor):
            raise ValueError(
                f"rope_scaling high_freq_factor {self.high_freq_factor} must be finite and above "
                f"low_freq_factor {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                "rope_scaling original_max_position_embeddings must be positive, got "
                f"{self.original_max_position_embeddings}"
            )


SLIDING, FULL = "sliding", "full"  # layer_types entries
# The most positions a config may claim: past every released model's context (a RoPE table
# of that many rows is built at load; a claim of 10^12 would be a terabyte)
MAX_POSITIONS = 1 << 24
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
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "max_position_embeddings",
        ):  # fmt: skip
            if getattr(self, key) <= 0:
                raise ValueError(f"{self.name}: {key} must be positive, got {getattr(self, key)}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(
                f"{self.name}: max_position_embeddings {self.max_position_embeddings} is past "
                f"{MAX_POSITIONS}, the most positions pagedkern builds a RoPE table for"
            )
        # (a base of at most 1 gives no rotation, or rising frequencies; YaRN divides by its log)
        for key in ("rope_theta", "rope_local_theta"):
            value = getattr(self, key)
            if value is not None and not 1 < value < math.inf:
                raise ValueError(f"{self.name}: {key} must be finite and above 1, got {value}")
        if not 0 <= self.rms_norm_eps < math.inf:
            eps = self.rms_norm_eps
            raise ValueError(f"{self.name}: rms_norm_eps must be finite and >= 0, got {eps}")
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
        if self.num_experts < 0:
            raise ValueError(f"{self.name}: num_experts must be >= 0, got {self.num_experts}")
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
