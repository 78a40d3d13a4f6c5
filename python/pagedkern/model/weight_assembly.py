"""A model's runtime weights assembled from checkpoint tensors under HF names: every tensor's
presence, shape and dtype checked, converted, checked finite as converted, and QKV and gate/up
fused (one GEMM each in the forward); a MoE layer's experts stacked as ops.fused_moe takes
them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .checkpoint_layout import expected_shapes, layer_norm_names, mixtral_name
from .config import ModelConfig
from .errors import ModelLoadError
from .gpt_oss import gpt_oss_experts
from .quantized_linear import QuantizedWeight, cat_rows, quantize_int8_grouped, stack_experts
from .tensor_shard import TensorShard
from .weights import HALF_DTYPES, LayerWeights, Linear, LlamaWeights


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _quantized_alike(parts: list[Linear], stacking: bool = False) -> bool:
    """Whether every part is a QuantizedWeight of one kind (format, group size, mins or not)
    and one input order (act-order's input_index; stacked experts take none): fused or stacked
    as they are; else as floats."""
    kinds = {p.kind if isinstance(p, QuantizedWeight) else None for p in parts}
    if len(kinds) != 1 or None in kinds:
        return False
    first = parts[0].input_index
    if first is None:
        return all(p.input_index is None for p in parts)
    return not stacking and all(
        p.input_index is not None and torch.equal(p.input_index, first) for p in parts
    )


def _act_order(parts: list[Linear]) -> bool:
    """Quantized experts in act-order (each its own input order, which no MoE kernel gathers
    by), whose in-features int8 per 32 divides."""
    return (
        all(isinstance(p, QuantizedWeight) for p in parts)
        and any(p.input_index is not None for p in parts)
        and parts[0].shape[-1] % 32 == 0
    )


# get(name) -> the tensor under that HF name (any float dtype, any device, or a QuantizedWeight)
# or None if absent.
TensorGetter = Callable[[str], "Linear | None"]


def _float_parts(t: Linear) -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors a weight is made of, named as an error shows them."""
    if isinstance(t, QuantizedWeight):
        return [
            (f"'s {n}", v) for n, v in (("scales", t.scales), ("mins", t.mins)) if v is not None
        ]
    return [("", t)]


def _finite(t: torch.Tensor) -> bool:
    """No NaN nor infinity in t (a corrupt checkpoint, or a value past the load dtype's range):
    on the device it was loaded to, no mask as large as t (min and max carry a NaN). On the
    host numpy's single-threaded min and max where it takes the dtype: torch's two-thread
    reduction waits ~8 ms a tensor for its second thread on a busy machine."""
    if t.numel() == 0:
        return True
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float16):
        values = t.numpy()
        return bool(np.isfinite(values.min()) and np.isfinite(values.max()))
    low, high = t.aminmax()
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _kept_16_bit(name: str) -> bool:
    """A dense layer's projection, the LM head or the embedding (not experts, routers, norms or
    biases)."""
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        return True
    return name.endswith("_proj.weight") and ".experts." not in name


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
    keep_16_bit: bool = False,
) -> LlamaWeights:
    """Check every tensor's presence and shape, convert to `dtype` on `device`, fuse QKV and
    gate/up (one GEMM each in the forward). Errors name the tensor as describe(HF name) and
    `source` (or source(HF name): the file holding it). norm_offset is added to every norm
    weight, in fp32 before the conversion (1 for Gemma's HF checkpoints, which store w for a
    scale of 1 + w; llama.cpp's GGUFs store 1 + w already). shard: one tensor-parallel rank's
    weights, reading its parts only (`get` then takes get(name, part): TensorShard.reader).
    keep_16_bit: the dense layers' projections, the embedding and the LM head stored in bf16 /
    fp16 keep that dtype under wider activations (the CPU's fp32 GEMM widens each weight
    exactly, as the embedding lookup does its rows: the same values and bits at half the memory
    and weight reads)."""
    shapes = expected_shapes(config)
    if shard is not None:
        get, shapes = shard.reader(config, get, shapes)
    if config.num_experts and not config.expert_bias:  # Mixtral's own MoE tensor names
        checkpoint_get = get

        def get(name: str) -> Linear | None:
            t = checkpoint_get(name)
            alias = None if t is not None else mixtral_name(name)
            return checkpoint_get(alias) if alias is not None else t

    def where(name: str) -> str:
        return source(name) if callable(source) else source

    def load(name: str, t: Linear | None = None) -> Linear:
        t = checked(name, get(name) if t is None else t)
        for part, values in _float_parts(t):
            if not _finite(values):
                raise ModelLoadError(
                    where(name),
                    f"tensor {describe(name)!r}{part} holds NaN or infinite values as "
                    f"{values.dtype} (a corrupt file, or values past that dtype's range)",
                )
        return t

    def checked(name: str, t: Linear | None) -> Linear:
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
        if t.dtype.itemsize == 1:  # fp8 without the scales a quantization_config names
            raise ModelLoadError(
                where(name), f"tensor {describe(name)!r} is {t.dtype}, with no scale to apply"
            )
        if keep_16_bit and t.dtype in HALF_DTYPES and _kept_16_bit(name):
            return t.to(device=device)
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
        if _quantized_alike(parts):
            return cat_rows(parts)
        if all(isinstance(p, QuantizedWeight) for p in parts) and parts[0].shape[1] % 32 == 0:
            # parts of two forms (a Q4_K_M / Q5_K_M file's Q6_K v beside its q and k): int8
            # per 32 of their values, within 1/254 of each group's largest weight
            whole = torch.cat([p.dequantize_rows() for p in parts])
            return quantize_int8_grouped(whole, 32).to(device)
        plain = [
            p.dequantize_rows(dtype=dtype) if isinstance(p, QuantizedWeight) else p for p in parts
        ]
        return torch.cat(plain)  # floats, put in the mode whole later

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
            every = [w for pair in pairs for w in pair]
            if _quantized_alike(every, stacking=True):
                return stack_experts(
                    [cat_rows(pair) if len(pair) > 1 else pair[0] for pair in pairs]
                )
            if _act_order(every):  # (the MoE kernels gather no input: int8 per 32, as above)
                return stack_experts(
                    [
                        quantize_int8_grouped(torch.cat([w.dequantize_rows() for w in pair]))
                        for pair in pairs
                    ]
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
