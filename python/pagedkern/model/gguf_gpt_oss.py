"""gpt-oss from GGUF files as llama.cpp writes them (arch "gpt-oss": convert_hf_to_gguf.py's
GptOssModel, read by llama.cpp as LLM_ARCH_OPENAI_MOE).

The converter splits the checkpoint's interleaved gate_up_proj [E, H, 2I] into
ffn_gate_exps / ffn_up_exps [E, I, H] (GGUF dims reversed: [H, I, E]) with their biases
ffn_{gate,up}_exps.bias [E, I], transposes down_proj into ffn_down_exps [E, H, I] (bias
[E, H]), names the router ffn_gate_inp (.weight, .bias), the sinks attn_sinks.weight [Hq] and
the post-attention norm post_attention_norm. MXFP4 experts (as released checkpoints hold them)
are repacked into GGML's block_mxfp4: one E8M0 byte, then 16 bytes whose low nibbles are
elements 0-15 and high nibbles 16-31 (the checkpoint pairs 2j / 2j + 1 in a byte); gguf-py's
dequantizer reads that layout, and the loader dequantizes them at load to float (as the HF
folder reader does; model/mxfp4.py says why not int4).

What the file does not store, llama.cpp hard-codes, and so does this reader: the clamped
SwiGLU's alpha 1.702 and limit 7.0, the top-k softmax routing, sliding-window layers
alternating from layer 0 (its swa pattern 2), YaRN's ramp bounds rounded to whole dimensions
(ggml_rope_yarn_corr_dims' floor / ceil: transformers' truncate=True, whereas gpt-oss's HF
configs say truncate false) and its attention factor 0.1 * ln(factor) + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .config import FULL, SLIDING, ModelConfig, RopeScaling
from .errors import ModelLoadError
from .gpt_oss import gpt_oss_fields
from .tensor_shard import Part, TensorShard

ARCH = "gpt-oss"

_NAMES = {  # gpt-oss's HF layer tensors whose GGUF names differ from the Llama family's
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
_EXPERTS = {  # HF stacked tensor -> the GGUF tensors it is made of
    "mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "mlp.experts.gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight",),
    "mlp.experts.down_proj_bias": ("ffn_down_exps.bias",),
}


def gpt_oss_gguf_name(hf_name: str) -> str | None:
    """The GGUF name of a gpt-oss HF layer tensor stored under one of its own names (the first
    part of a split one), else None (the Llama family's names apply)."""
    if not hf_name.startswith("model.layers."):
        return None
    _, _, layer, rest = hf_name.split(".", 3)
    if rest in _NAMES:
        return f"blk.{layer}.{_NAMES[rest]}"
    if rest in _EXPERTS:
        return f"blk.{layer}.{_EXPERTS[rest][0]}"
    return None


def gpt_oss_gguf_tensor(hf_name: str, read: Callable[[str], torch.Tensor | None]) -> Any:
    """A gpt-oss expert tensor in the HF checkpoint's layout, rebuilt from the GGUF tensors
    read(GGUF name) gives as float ([E, out, in] for a weight): gate / up interleaved again
    (gate 0, up 0, gate 1, ...) and transposed to x @ W form. NotImplemented for another
    tensor; None if a part is missing (the shape check reports it)."""
    if not hf_name.startswith("model.layers."):
        return NotImplemented
    _, _, layer, rest = hf_name.split(".", 3)
    if rest not in _EXPERTS:
        return NotImplemented
    parts = [read(f"blk.{layer}.{name}") for name in _EXPERTS[rest]]
    if any(p is None for p in parts):
        return None
    if rest == "mlp.experts.down_proj":  # [E, H, I] -> [E, I, H]
        return parts[0].transpose(1, 2).contiguous()
    if rest == "mlp.experts.down_proj_bias":
        return parts[0]
    gate, up = parts
    if gate.shape != up.shape:
        return None  # (reported as the stacked tensor's shape)
    both = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2I(, H)] interleaved
    return both.transpose(1, 2).contiguous() if both.dim() == 3 else both


def gpt_oss_gguf_parts(config: ModelConfig, shard: TensorShard) -> dict[str, Part]:
    """A tensor-parallel rank's parts of the GGUF expert tensors (gguf_shard.cut_tensors' dims:
    rows / columns of the last two): its slice of the intermediate size, the rows of
    ffn_gate_exps / ffn_up_exps [E, I, H], the columns of their biases [E, I] and of
    ffn_down_exps [E, H, I] (whose bias is rank 0's: TensorShard drops it elsewhere)."""
    inter = config.moe_intermediate_size
    rows = shard.mlp_rows(inter)
    parts: dict[str, Part] = {}
    for n in range(config.num_layers):
        if config.is_moe_layer(n):
            for proj in ("ffn_gate_exps", "ffn_up_exps"):
                parts[f"blk.{n}.{proj}.weight"] = Part(0, rows.start, rows.stop, inter)
                parts[f"blk.{n}.{proj}.bias"] = Part(1, rows.start, rows.stop, inter)
            parts[f"blk.{n}.ffn_down_exps.weight"] = Part(1, rows.start, rows.stop, inter)
    return parts


def gpt_oss_gguf_fields(meta: dict[str, Any], layers: int, path: str) -> dict[str, Any]:
    """The ModelConfig fields of a gpt-oss GGUF beyond the Llama and MoE ones, as llama.cpp
    reads the file (module docstring): the sliding window and its alternating layers, YaRN, and
    gpt-oss's routing and activation constants."""
    window = meta.get(f"{ARCH}.attention.sliding_window")
    if window is None or int(window) <= 0:
        raise ModelLoadError(
            path, f"GGUF metadata lacks a positive {ARCH}.attention.sliding_window"
        )
    return dict(
        sliding_window=int(window),
        layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers)),
        **gpt_oss_fields({}, path),
    )


def yarn_from_gguf(meta: dict[str, Any], arch: str, path: str) -> RopeScaling:
    """YaRN as llama.cpp applies it from a GGUF's rope.scaling keys (ramp bounds rounded)."""
    key = f"{arch}.rope.scaling."
    factor, original = meta.get(key + "factor"), meta.get(key + "original_context_length")
    if factor is None or original is None:
        raise ModelLoadError(path, f"yarn needs {key}factor and {key}original_context_length")
    for extra in ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier"):
        value = meta.get(key + extra)
        if value is not None and float(value) != (0.0 if extra == "yarn_log_multiplier" else 1.0):
            raise ModelLoadError(path, f"unsupported: {key}{extra} = {value}")
    return RopeScaling(
        "yarn",
        float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(meta.get(key + "yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(key + "yarn_beta_slow", 1.0)),
        truncate=True,
    )
