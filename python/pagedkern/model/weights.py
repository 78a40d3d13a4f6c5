"""Runtime weights of a Llama-family model, fused for the forward, and their assembly from
checkpoint tensors under HF names (every loader maps its format onto those names)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .config import ModelConfig
from .errors import ModelLoadError


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [Hq*D + 2*Hkv*D, H]: q rows, k rows, v rows; rotate-half RoPE layout
    o: torch.Tensor  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]: gate rows then up rows, the halves silu_and_mul expects
    down: torch.Tensor  # [H, I]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(slots=True)
class LlamaWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embed tensor itself when embeddings are tied
    rope_freq_factors: torch.Tensor | None = None  # [D/2] fp32, divides the RoPE frequencies

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LlamaWeights:
        """A copy on `device` in `dtype` (tensors already there are shared, ties kept)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        layers = [
            LayerWeights(**{f.name: move(getattr(layer, f.name)) for f in fields(LayerWeights)})
            for layer in self.layers
        ]
        embed = move(self.embed)
        factors = self.rope_freq_factors
        return LlamaWeights(
            embed,
            layers,
            move(self.norm),
            embed if self.tied else move(self.lm_head),
            None if factors is None else factors.to(device=device, dtype=torch.float32),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map (the weights cache format); a tied lm_head is left out."""
        out = {"embed": self.embed, "norm": self.norm}
        if not self.tied:
            out["lm_head"] = self.lm_head
        if self.rope_freq_factors is not None:
            out["rope_freq_factors"] = self.rope_freq_factors
        for i, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                t = getattr(layer, f.name)
                if t is not None:
                    out[f"layers.{i}.{f.name}"] = t
        return out

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: dict[str, torch.Tensor]) -> LlamaWeights:
        layers = [
            LayerWeights(**{f.name: sd.get(f"layers.{i}.{f.name}") for f in fields(LayerWeights)})
            for i in range(config.num_layers)
        ]
        embed = sd["embed"]
        lm_head = embed if config.tie_word_embeddings else sd["lm_head"]
        return cls(embed, layers, sd["norm"], lm_head, sd.get("rope_freq_factors"))


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
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, h)
            if config.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if config.mlp_bias:
            for name, rows in (("gate_proj", i), ("up_proj", i), ("down_proj", h)):
                shapes[p + f"mlp.{name}.bias"] = (rows,)
    return shapes


# get(name) -> the tensor under that HF name (any float dtype, any device) or None if absent.
TensorGetter = Callable[[str], "torch.Tensor | None"]


def assemble_weights(
    config: ModelConfig,
    get: TensorGetter,
    source: str | Callable[[str], str],
    device: torch.device | str,
    dtype: torch.dtype,
    rope_freq_factors: torch.Tensor | None = None,
    describe: Callable[[str], str] = str,
) -> LlamaWeights:
    """Check every tensor's presence and shape, convert to `dtype` on `device`, fuse QKV and
    gate/up (one GEMM each in the forward). Errors name the tensor as describe(HF name) and
    `source` (or source(HF name): the file holding it)."""
    shapes = expected_shapes(config)

    def where(name: str) -> str:
        return source(name) if callable(source) else source

    def load(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(where(name), f"tensor {describe(name)!r} is missing")
        if tuple(t.shape) != shapes[name]:
            raise ModelLoadError(
                where(name),
                f"tensor {describe(name)!r} has shape {tuple(t.shape)}, expected {shapes[name]}",
            )
        if not t.dtype.is_floating_point:
            raise ModelLoadError(
                where(name), f"tensor {describe(name)!r} has non-float dtype {t.dtype}"
            )
        return t.to(device=device, dtype=dtype)

    def maybe(name: str) -> torch.Tensor | None:
        return load(name) if name in shapes else None

    def cat(names: list[str]) -> torch.Tensor | None:
        if names[0] not in shapes:
            return None
        return torch.cat([load(n) for n in names])

    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        attn = [p + f"self_attn.{x}_proj." for x in "qkv"]
        mlp = [p + f"mlp.{x}_proj." for x in ("gate", "up")]
        layers.append(
            LayerWeights(
                input_norm=load(p + "input_layernorm.weight"),
                qkv=cat([a + "weight" for a in attn]),
                o=load(p + "self_attn.o_proj.weight"),
                post_norm=load(p + "post_attention_layernorm.weight"),
                gate_up=cat([m + "weight" for m in mlp]),
                down=load(p + "mlp.down_proj.weight"),
                qkv_bias=cat([a + "bias" for a in attn]),
                o_bias=maybe(p + "self_attn.o_proj.bias"),
                gate_up_bias=cat([m + "bias" for m in mlp]),
                down_bias=maybe(p + "mlp.down_proj.bias"),
            )
        )
    embed = load("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else load("lm_head.weight")
    if rope_freq_factors is not None:
        rope_freq_factors = rope_freq_factors.to(device=device, dtype=torch.float32)
    return LlamaWeights(embed, layers, load("model.norm.weight"), lm_head, rope_freq_factors)
