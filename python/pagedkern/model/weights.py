"""Runtime weights of a Llama-family model, fused for the forward, and their assembly from
checkpoint tensors under HF names (every loader maps its format onto those names)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .config import ModelConfig
from .errors import ModelLoadError
from .gpt_oss import gpt_oss_experts, gpt_oss_moe_shapes
from .quantized_linear import (
    QuantizedWeight,
    cat_rows,
    quantizable,
    quantize,
    quantize_experts,
    stack_experts,
)
from .tensor_shard import TensorShard

# A linear layer's weight: a float tensor or a weight-only quantized one.
Linear = torch.Tensor | QuantizedWeight
LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")
# The LM head's format per mode (measured in bench/test_bench_quant.py; see README).
LM_HEAD_MODE = {"none": "none", "int8": "int8", "int4": "int8"}


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [Hq*D + 2*Hkv*D, H]: q rows, k rows, v rows; rotate-half RoPE layout
    o: Linear  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear | None  # [2I, H]: gate rows then up rows, the halves silu_and_mul expects
    down: Linear | None  # [H, I]; both None in a MoE layer without a shared expert
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D]: QK-norm (Qwen3), per query head before RoPE
    k_norm: torch.Tensor | None = None  # [D]: per key head
    # Sandwich norms (Gemma): the attention output normed before its residual add (HF's
    # post_attention_layernorm there; post_norm is then its pre_feedforward_layernorm) and the
    # MLP output likewise (post_feedforward_layernorm).
    attn_out_norm: torch.Tensor | None = None  # [H]
    mlp_out_norm: torch.Tensor | None = None  # [H]
    # A mixture-of-experts layer (config.is_moe_layer): the router and every expert's weights
    # stacked at load, as ops.fused_moe takes them. gate_up / down then hold the shared expert
    # (Qwen2-MoE), whose output is scaled by sigmoid(shared_gate . x).
    router: torch.Tensor | None = None  # [E, H]
    # (float, or stacked QuantizedWeights [E, N, K] when the layers are quantized)
    experts_gate_up: Linear | None = None  # [E, 2I, H]: each expert's gate rows, up rows
    experts_down: Linear | None = None  # [E, H, I]
    shared_gate: torch.Tensor | None = None  # [1, H]
    # gpt-oss (model/gpt_oss.py): per-head sink logits (float32), the router's and the experts'
    # biases (gate_up's in experts_gate_up's row order)
    sinks: torch.Tensor | None = None  # [Hq] float32
    router_bias: torch.Tensor | None = None  # [E]
    experts_gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    experts_down_bias: torch.Tensor | None = None  # [E, H]


@dataclass(slots=True)
class LlamaWeights:
    embed: Linear  # [V, H]; quantized only when tied to a quantized LM head (rows dequantized)
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: Linear  # [V, H]; the embed tensor itself when embeddings are tied
    rope_freq_factors: torch.Tensor | None = None  # [D/2] fp32, divides the RoPE frequencies

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LlamaWeights:
        """A copy on `device` in `dtype` (tensors already there are shared, ties kept)."""

        def move(t: Linear | None, dtype: torch.dtype = dtype) -> Linear | None:
            if isinstance(t, QuantizedWeight):
                return t.to(device)
            return None if t is None else t.to(device=device, dtype=dtype)

        def field_dtype(name: str) -> torch.dtype:
            return torch.float32 if name == "sinks" else dtype  # (the kernels read fp32 sinks)

        layers = [
            LayerWeights(
                **{
                    f.name: move(getattr(layer, f.name), field_dtype(f.name))
                    for f in fields(LayerWeights)
                }
            )
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

    @property
    def quantization(self) -> str:
        """'int8' / 'int4' (the format of the layers' linear weights) or 'none'."""
        qkv = self.layers[0].qkv if self.layers else None
        return qkv.format if isinstance(qkv, QuantizedWeight) else "none"

    @property
    def nbytes(self) -> int:
        """Bytes of every weight in memory (a tied head counted once)."""
        seen: dict[int, int] = {}
        for t in self.state_dict().values():
            seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map (the weights cache format); a tied lm_head is left out, a
        quantized weight is stored as its parts (<name>.qweight, .scales, .mins, .qmeta)."""
        out: dict[str, torch.Tensor] = {}

        def put(name: str, t: Linear | None) -> None:
            if isinstance(t, QuantizedWeight):
                out.update(t.state_dict(name))
            elif t is not None:
                out[name] = t

        put("embed", self.embed)
        put("norm", self.norm)
        if not self.tied:
            put("lm_head", self.lm_head)
        put("rope_freq_factors", self.rope_freq_factors)
        for i, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                put(f"layers.{i}.{f.name}", getattr(layer, f.name))
        return out

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: dict[str, torch.Tensor]) -> LlamaWeights:
        def get(name: str) -> Linear | None:
            return QuantizedWeight.from_state_dict(name, sd) or sd.get(name)

        layers = [
            LayerWeights(**{f.name: get(f"layers.{i}.{f.name}") for f in fields(LayerWeights)})
            for i in range(config.num_layers)
        ]
        embed = get("embed")
        lm_head = embed if config.tie_word_embeddings else get("lm_head")
        return cls(embed, layers, sd["norm"], lm_head, sd.get("rope_freq_factors"))


def quantize_weights(
    weights: LlamaWeights, mode: str, group_size: int, head_mode: str | None = None
) -> LlamaWeights:
    """Every layer's linear weights in `mode` ('none' / 'int8' / 'int4') and the LM head in
    head_mode (default: LM_HEAD_MODE[mode]); weights already in the target format are kept as
    they are, others are requantized from their floats ('none': dequantized to fp32). A tied
    embedding follows the head (its rows are dequantized at lookup). A MoE layer's stacked
    experts follow the layers' mode (convert_experts)."""

    def convert(w: Linear | None, mode: str = mode) -> Linear | None:
        if w is None:  # (a MoE layer's absent dense MLP)
            return None
        if isinstance(w, QuantizedWeight):
            if w.format == mode and (mode == "int8" or w.group_size == group_size):
                return w
            w = w.dequantize_rows()
        return w.float() if mode == "none" else quantize(w, mode, group_size)

    def plain(w: Linear) -> torch.Tensor:
        return w.dequantize_rows() if isinstance(w, QuantizedWeight) else w

    def convert_experts(layer: LayerWeights) -> dict[str, Linear | None]:
        """The stacked experts in `mode`: both GEMMs or neither (they stay float where an
        in-features count does not divide into the mode's blocks)."""
        pair = {"experts_gate_up": layer.experts_gate_up, "experts_down": layer.experts_down}
        if layer.experts_gate_up is None:
            return pair
        if mode == "none" or not all(
            quantizable(w.shape[-1], mode, group_size) for w in pair.values()
        ):
            return {name: plain(w).float() for name, w in pair.items()}
        return {
            name: w
            if isinstance(w, QuantizedWeight)
            and w.format == mode
            and (mode == "int8" or w.group_size == group_size)
            else quantize_experts(plain(w), mode, group_size)
            for name, w in pair.items()
        }

    layers = [
        LayerWeights(
            **{
                f.name: convert(v) if f.name in LINEAR_FIELDS else v
                for f in fields(LayerWeights)
                for v in [getattr(layer, f.name)]
            }
            | convert_experts(layer)
        )
        for layer in weights.layers
    ]
    head = convert(weights.lm_head, LM_HEAD_MODE[mode] if head_mode is None else head_mode)
    embed = head if weights.tied else plain(weights.embed)
    return LlamaWeights(embed, layers, weights.norm, head, weights.rope_freq_factors)


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
    _mixtral_name): the router, each expert's gate/up/down, the shared expert and its gate."""
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


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _mixtral_name(name: str) -> str | None:
    """Mixtral's checkpoint name of a MoE tensor named as _moe_shapes names it, else None:
    block_sparse_moe.gate (the router) and block_sparse_moe.experts.<e>.w1 / w3 / w2."""
    if ".mlp.gate." in name:
        return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if ".mlp.experts." not in name:
        return None
    head, _, tail = name.partition(".mlp.experts.")
    e, proj, rest = tail.split(".", 2)
    return f"{head}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT[proj]}.{rest}"


# get(name) -> the tensor under that HF name (any float dtype, any device, or a QuantizedWeight)
# or None if absent.
TensorGetter = Callable[[str], "Linear | None"]


def assemble_weights(
    config: ModelConfig,
    get: TensorGetter,
    source: str | Callable[[str], str],
    device: torch.device | str,
    dtype: torch.dtype,
    rope_freq_factors: torch.Tensor | None = None,
    describe: Callable[[str], str] = str,
    norm_offset: float = 0.0,
    shard: TensorShard | None = None,
) -> LlamaWeights:
    """Check every tensor's presence and shape, convert to `dtype` on `device`, fuse QKV and
    gate/up (one GEMM each in the forward). Errors name the tensor as describe(HF name) and
    `source` (or source(HF name): the file holding it). norm_offset is added to every norm
    weight, in fp32 before the conversion (1 for Gemma's HF checkpoints, which store w for a
    scale of 1 + w; llama.cpp's GGUFs store 1 + w already). shard: one tensor-parallel rank's
    weights, reading its parts only (`get` then takes get(name, part): TensorShard.reader)."""
    shapes = expected_shapes(config)
    if shard is not None:
        get, shapes = shard.reader(config, get, shapes)
    if config.num_experts and not config.expert_bias:  # Mixtral's own MoE tensor names
        checkpoint_get = get

        def get(name: str) -> Linear | None:
            t = checkpoint_get(name)
            alias = None if t is not None else _mixtral_name(name)
            return checkpoint_get(alias) if alias is not None else t

    def where(name: str) -> str:
        return source(name) if callable(source) else source

    def load(name: str, t: Linear | None = None) -> Linear:
        t = get(name) if t is None else t
        if isinstance(t, QuantizedWeight):
            if tuple(t.shape) != shapes[name]:
                raise ModelLoadError(
                    where(name),
                    f"tensor {describe(name)!r} has shape {t.shape}, expected {shapes[name]}",
                )
            return t.to(device)
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

    def norm(name: str | None) -> torch.Tensor | None:
        if name is None or name not in shapes:
            return None
        if not norm_offset:
            return load(name)
        t = get(name)
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            t = t.float() + norm_offset  # (shape and presence: load's checks, below)
        return load(name, t)

    def cat(names: list[str]) -> Linear | None:
        if names[0] not in shapes:
            return None
        parts = [load(n) for n in names]
        if all(isinstance(p, QuantizedWeight) for p in parts):
            return cat_rows(parts)
        plain = [
            p.dequantize_rows(dtype=dtype) if isinstance(p, QuantizedWeight) else p for p in parts
        ]
        return torch.cat(plain)

    def floats(t: Linear) -> torch.Tensor:
        return t.dequantize_rows(dtype=dtype) if isinstance(t, QuantizedWeight) else t

    def experts(p: str) -> dict[str, Linear | None]:
        """A MoE layer's router and stacked experts (LayerWeights fields), {} for a dense one."""
        if p + "mlp.router.bias" in shapes:
            return gpt_oss_experts(p, load, maybe)
        if p + "mlp.gate.weight" not in shapes:
            return {}
        # Each projection's experts stay quantized (stacked [E, N, K]) when all of its parts
        # are, in one format, else float; quantize_weights then puts both in the layers' mode
        # (convert_experts: ops.fused_moe takes both GEMMs in one form).
        x = [f"{p}mlp.experts.{e}." for e in range(config.num_experts)]
        x = [e for e in x if e + "down_proj.weight" in shapes]  # (expert parallel: its own)

        def stacked(pairs: list[list[Linear]]) -> Linear:
            parts = [w for pair in pairs for w in pair]
            kinds = {
                (w.format, w.group_size) if isinstance(w, QuantizedWeight) else None for w in parts
            }
            if len(kinds) == 1 and None not in kinds:
                return stack_experts(
                    [cat_rows(pair) if len(pair) > 1 else pair[0] for pair in pairs]
                )
            return torch.stack([torch.cat([floats(w) for w in pair]) for pair in pairs])

        stacked_gate_up = stacked(
            [[load(e + "gate_proj.weight"), load(e + "up_proj.weight")] for e in x]
        )
        stacked_down = stacked([[load(e + "down_proj.weight")] for e in x])
        return dict(
            router=floats(load(p + "mlp.gate.weight")),
            experts_gate_up=stacked_gate_up,
            experts_down=stacked_down,
            shared_gate=maybe(p + "mlp.shared_expert_gate.weight"),
        )

    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        attn = [p + f"self_attn.{x}_proj." for x in "qkv"]
        mlp = [p + f"mlp.{x}_proj." for x in ("gate", "up")]
        down = p + "mlp.down_proj.weight"
        if config.is_moe_layer(n):  # its dense MLP: the shared expert, if any
            mlp = [p + f"mlp.shared_expert.{x}_proj." for x in ("gate", "up")]
            down = p + "mlp.shared_expert.down_proj.weight"
        norms = [None if x is None else p + x + ".weight" for x in layer_norm_names(config)]
        layers.append(
            LayerWeights(
                input_norm=norm(norms[0]),
                qkv=cat([a + "weight" for a in attn]),
                o=load(p + "self_attn.o_proj.weight"),
                post_norm=norm(norms[1]),
                gate_up=cat([m + "weight" for m in mlp]),
                down=maybe(down),
                qkv_bias=cat([a + "bias" for a in attn]),
                o_bias=maybe(p + "self_attn.o_proj.bias"),
                gate_up_bias=cat([m + "bias" for m in mlp]),
                down_bias=maybe(p + "mlp.down_proj.bias"),
                q_norm=norm(p + "self_attn.q_norm.weight"),
                k_norm=norm(p + "self_attn.k_norm.weight"),
                attn_out_norm=norm(norms[2]),
                mlp_out_norm=norm(norms[3]),
                sinks=_fp32(maybe(p + "self_attn.sinks")),
                **experts(p),
            )
        )
    embed = load("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else load("lm_head.weight")
    if rope_freq_factors is not None:
        rope_freq_factors = rope_freq_factors.to(device=device, dtype=torch.float32)
    return LlamaWeights(embed, layers, norm("model.norm.weight"), lm_head, rope_freq_factors)
