"""Models from GGUF files (llama.cpp's format), read with the `gguf` package.

Quantized tensors are dequantized with gguf.quants.dequantize to fp32. llama.cpp stores the Q
and K projections of "llama" models permuted for its interleaved RoPE (pairs 2i, 2i+1); the
loader undoes that so every model uses rotate-half RoPE (halves i, i + D/2). The converted model
is cached (weights_cache), so only the first load of a file pays for parsing and dequantizing.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .config import ModelConfig, RopeScaling
from .errors import ModelLoadError
from .gguf_tokenizer import tokenizer_from_gguf
from .tokenizer import Tokenizer
from .weights import LlamaWeights, assemble_weights
from .weights_cache import file_sha256, load_entry, store_entry

_ARCHITECTURES = {"llama": True, "qwen2": False}  # arch -> Q/K stored permuted

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """HF tensor name -> GGUF name: model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    for hf, gg in _LAYER_NAMES.items():
        if rest.startswith(hf):
            return f"blk.{layer}.{gg}{rest[len(hf) :]}"
    raise KeyError(hf_name)


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: within each head, rows (2i, 2i+1) go back to
    (i, i + D/2). Works on weights [heads*D, in] and biases [heads*D]."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _open(path: str):
    from gguf import GGUFReader  # imported here: it is only needed for the first load

    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError, ...
        problem = f"truncated or corrupted GGUF file ({type(exc).__name__}: {exc})"
        raise ModelLoadError(path, problem) from None
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as exc:
            raise ModelLoadError(path, f"corrupted GGUF metadata {key!r}: {exc}") from None
    return reader, meta


def _config(meta: dict[str, Any], tensors: dict, path: str) -> tuple[ModelConfig, bool]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(_ARCHITECTURES)})"
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(path, "tensor 'token_embd.weight' is missing")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {arch}.{key}")
        return value

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(path, "partial rotary embeddings are not supported")
    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
    elif scaling_type != "none":
        raise ModelLoadError(path, f"unsupported rope scaling type {scaling_type!r}")
    try:
        config = ModelConfig(
            name=str(meta.get("general.name") or os.path.basename(path)),
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors,
        )
    except ValueError as exc:
        raise ModelLoadError(path, str(exc)) from None
    return config, _ARCHITECTURES[arch]


def _convert(path: str) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    from gguf.quants import dequantize

    reader, meta = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    config, permuted = _config(meta, tensors, path)
    tokenizer = tokenizer_from_gguf(meta, path)

    def read(name: str) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None:
            return None
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(path, f"tensor {name!r} is unreadable: {exc}") from None
        # Reversed GGUF dims ([in, out]) are numpy's [out, in]: HF's layout.
        arr = arr.reshape([int(n) for n in reversed(t.shape)])
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def get(hf_name: str) -> torch.Tensor | None:
        w = read(gguf_name(hf_name))
        if w is not None and permuted and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = config.num_heads if ".q_proj" in hf_name else config.num_kv_heads
            if w.shape[0] % (2 * heads) == 0:  # else let the shape check report it
                w = unpermute_rope(w, heads)
        return w

    factors = read("rope_freqs.weight")
    # Shapes are checked and reported in torch order [out, in] (GGUF lists dims reversed).
    weights = assemble_weights(config, get, path, "cpu", torch.float32, factors, gguf_name)
    return config, weights, tokenizer


def read_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads the metadata, no tensor data)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "no such file")
    return tokenizer_from_gguf(_open(path)[1], path)


def load_gguf(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    use_cache: bool = True,
) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    """Config, weights (on `device` in `dtype`) and tokenizer of a GGUF model file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "no such file")
    digest = file_sha256(path) if use_cache else None
    if digest is not None:
        hit = load_entry("gguf", digest, device, dtype)
        if hit is not None:
            return hit
    config, weights, tokenizer = _convert(path)
    if digest is not None:
        store_entry("gguf", digest, config, weights, tokenizer)
    return config, weights.to(device, dtype), tokenizer
