"""Models from GGUF files (llama.cpp's format), read with the `gguf` package.

Quantized tensors are dequantized with gguf.quants.dequantize to fp32, except where they map
straight onto the target format (quantized_linear): Q4_0/Q4_1/Q4_K layer weights onto int4,
Q8_0 and Q6_K exactly onto int8 with a scale per 32 / 16 weights, Q5_0 / Q5_1 / Q5_K onto int8
codes with a scale and a min per 32, Q3_K / IQ4_XS / IQ4_NL onto int8 codes with a scale per
16 / 32 (in int4 and int8 mode, and the LM head whenever it is int8): a Q4_K_M, Q5_K_M, Q3_K or
IQ4_XS file's tensors keep the values its quantizer gave them. A fused
projection whose parts differ (Q4_K q and k beside a Q6_K v) is requantized whole to int8 with a
scale per 32 (weight_assembly).
llama.cpp stores the Q and K projections of "llama" models permuted for its interleaved RoPE
(pairs 2i, 2i+1); the loader undoes that so every model uses rotate-half RoPE (halves i,
i + D/2). The converted model is cached (weights_cache), so only the first load of a file pays
for parsing and dequantizing. The metadata's reading: gguf_config.py; the tensor names:
gguf_names.py.
Mixtures of experts (Mixtral as "llama" with expert_count, qwen2moe, qwen3moe, olmoe): each
expert's weights are slices of the stacked ffn_{gate,up,down}_exps tensors, mapped as the layer
weights are (Q4_0/Q4_1/Q4_K experts onto int4 G = 32 in int4 mode, Q8_0 onto int8 in int8 mode,
kept stacked [E, N, K] for ops.fused_moe), else dequantized to float at load. gpt-oss
("gpt-oss"): gguf_gpt_oss.py (its MXFP4 experts dequantized to float at load).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_config import config_from_gguf
from .gguf_gpt_oss import gpt_oss_gguf_parts, gpt_oss_gguf_tensor
from .gguf_names import expert_slice, gguf_name, holder, unpermute_rope
from .gguf_shard import cut_experts, cut_tensors, narrow_columns, shard_tensors
from .gguf_tokenizer import tokenizer_from_gguf
from .quantized_linear import (
    DEFAULT_INT4_GROUP,
    QuantizedWeight,
    as_experts,
    gguf_to_int4,
    gguf_to_int8,
    permute_rows,
)
from .tensor_shard import TensorShard
from .tokenizer import Tokenizer
from .weight_assembly import assemble_weights
from .weight_quantization import LM_HEAD_MODE, quantize_weights
from .weights import LlamaWeights
from .weights_cache import cached_default, file_sha256, load_entry, store_default, store_entry


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


def _convert(
    path: str, quantization: str, group_size: int, shard: TensorShard | None = None
) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    from gguf.quants import dequantize

    reader, meta = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    config, permuted = config_from_gguf(meta, tensors, path)
    narrow = {}  # a shard's parts are cut from the mapped tensors before anything is read
    experts_narrow = {}  # (gpt-oss's experts, narrowed as read, before their rebuild)
    if shard is not None:
        shard.check(config)
        cut_experts(tensors, config, shard)  # (expert parallel: before the other cuts)
        if config.attn_sinks:
            experts_narrow = cut_tensors(tensors, gpt_oss_gguf_parts(config, shard))
        narrow = shard_tensors(tensors, config, shard, lambda n: holder(n, config))
    tokenizer = tokenizer_from_gguf(meta, path)

    # Tensors whose target format is int8 whatever the layers': the LM head (and a tied
    # embedding, which is the head); an untied embedding stays float.
    head_int8 = LM_HEAD_MODE[quantization] == "int8"
    tied = "output.weight" not in tensors
    head = "token_embd.weight" if tied else "output.weight"
    int8_tensors = {head} if head_int8 else set()
    float_tensors = set() if tied else {"token_embd.weight"}

    def read(name: str, mapped: bool = True):
        t = tensors.get(name)
        if t is None:
            return None
        # (no fp32 detour where it maps)
        if mapped and quantization != "none" and len(t.shape) in (2, 3):
            *outer, k = (int(x) for x in reversed(t.shape))  # [E,] N, K
            n = int(np.prod(outer))  # (stacked experts: their rows one after the other)
            direct, kind = None, t.tensor_type.name
            if name in int8_tensors or (quantization == "int8" and name not in float_tensors):
                direct = gguf_to_int8(kind, t.data, n, k)  # Q8_0, Q6_K, Q5_*, Q3_K, IQ4_*
            elif quantization == "int4" and name not in float_tensors:
                # 4-bit blocks onto int4 G = 32; gguf_to_int8's types keep their values
                direct = gguf_to_int8(kind, t.data, n, k)
                if direct is None and group_size == 32:
                    direct = gguf_to_int4(kind, t.data, n, k)
            if direct is not None:
                return as_experts(direct, outer[0]) if len(outer) == 2 else direct
        if quantization == "none" and len(t.shape) == 2 and t.tensor_type.name in _16_BIT:
            return _16_bit_tensor(t)  # (assemble_weights widens what does not stay 16-bit)
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(path, f"tensor {name!r} is unreadable: {exc}") from None
        # Reversed GGUF dims ([in, out]) are numpy's [out, in]: HF's layout.
        arr = arr.reshape([int(n) for n in reversed(t.shape)])
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def name(hf_name: str) -> str:
        return gguf_name(hf_name, config.sandwich_norms, config.attn_sinks)

    def read_expert(name: str) -> torch.Tensor | None:
        w, cut = read(name, mapped=False), experts_narrow.get(name)
        return w if w is None or cut is None else narrow_columns(w, *cut, name)

    stacks: dict[str, torch.Tensor | None] = {}  # the current MoE layer's stacked experts

    def get(hf_name: str) -> torch.Tensor | None:
        if config.attn_sinks:  # gpt-oss: its experts rebuilt in the checkpoint's layout
            w = gpt_oss_gguf_tensor(hf_name, read_expert)
            if w is not NotImplemented:
                return w
        if (stacked := expert_slice(hf_name)) is not None:
            stack_name, e = stacked
            e -= getattr(tensors.get(stack_name), "first_expert", 0)  # (expert parallel)
            if stack_name not in stacks:
                layer = stack_name.split(".")[1]
                if any(k.split(".")[1] != layer for k in stacks):
                    stacks.clear()  # one layer's stacks at a time
                stacks[stack_name] = read(stack_name)
            w = stacks[stack_name]
            if w is None or e >= w.shape[0]:
                return None
            return w.expert(e) if isinstance(w, QuantizedWeight) else w[e]
        w = read(name(hf_name))
        if w is not None and hf_name.endswith("mlp.shared_expert_gate.weight") and w.ndim == 1:
            w = w.reshape(1, -1)
        if w is not None and permuted and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = w.shape[0] // config.head_dim  # (a shard's heads only)
            if w.shape[0] % (2 * heads) == 0:  # else let the shape check report it
                if isinstance(w, torch.Tensor):
                    w = unpermute_rope(w, heads)
                else:
                    w = permute_rows(w, lambda t, h=heads: unpermute_rope(t, h))
        return w

    factors = read("rope_freqs.weight")
    # Shapes are checked and reported in torch order [out, in] (GGUF lists dims reversed).
    # (Gemma's norms as stored: llama.cpp's converter added the 1 of 1 + w already)

    def get_part(hf_name: str, part=None) -> torch.Tensor | None:  # (part: cut already)
        w = get(hf_name)
        cut = narrow.get(holder(hf_name, config))
        return w if w is None or cut is None else narrow_columns(w, *cut, name(hf_name))

    weights = assemble_weights(
        config, get_part, path, "cpu", torch.float32, factors, name, shard=shard,
        keep_16_bit=quantization == "none",
    )  # fmt: skip
    return config, quantize_weights(weights, quantization, group_size), tokenizer


# F16 / BF16 tensors, read as they are (the reader gives BF16 as bytes)
_16_BIT = {"F16": torch.float16, "BF16": torch.bfloat16}


def _16_bit_tensor(t) -> torch.Tensor:
    """An F16 / BF16 GGUF matrix as a torch tensor of its dtype, [out, in]."""
    shape = [int(n) for n in reversed(t.shape)]
    bits = np.ascontiguousarray(t.data).view(np.int16).reshape(shape)
    return torch.from_numpy(bits.copy()).view(_16_BIT[t.tensor_type.name])


def gguf_default_quantization(path: str | os.PathLike) -> str:
    """The mode that keeps every layer weight as the file has it (reads the tensor table
    only): 'int8' when they are all Q8_0 / Q6_K / Q5_0 / Q5_1 / Q5_K / Q3_K / IQ4_XS / IQ4_NL
    (e.g. a Q5_K_M or IQ4_XS file), 'int4' when they are those and 4-bit blocks (Q4_0 / Q4_1
    / Q4_K, e.g. the default model, or a Q4_K_M or Q3_K_M file), else 'none'; a mixture of
    experts' stacked experts count as layer weights."""
    reader, _ = _open(os.fspath(path))
    kinds = {
        t.tensor_type.name
        for t in reader.tensors
        if t.name.startswith("blk.")
        and len(t.shape) > 1  # (norms, biases)
        and not t.name.endswith(".bias")  # (gpt-oss's experts' biases are 2-D, F32)
        and "ffn_gate_inp" not in t.name  # the router, F32 in llama.cpp's files, stays float
    }
    exact = {"Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "IQ4_XS", "IQ4_NL"}  # gguf_to_int8
    if kinds and kinds <= exact:
        return "int8"
    return "int4" if kinds and kinds <= exact | {"Q4_0", "Q4_1", "Q4_K"} else "none"


def gguf_architecture(path: str | os.PathLike) -> str | None:
    """general.architecture (None where the file names none: load_gguf reports that). Read
    from the header's first key, where llama.cpp's writers put it: parsing the metadata (a
    vocabulary's arrays) takes seconds, and a weights-cache hit parses nothing."""
    key = len(_ARCH_KEY).to_bytes(8, "little") + _ARCH_KEY
    with open(path, "rb") as f:
        # magic, version, tensor and key counts (24 bytes); the first key (its length, its
        # name), its value's type (8: a string) and the string's length
        head = f.read(24 + len(key) + 4 + 8)
        if head[:4] == b"GGUF" and head[24:-12] == key and head[-12:-8] == b"\x08\0\0\0":
            size = int.from_bytes(head[-8:], "little")
            if size <= 256:
                return f.read(size).decode("utf-8", "replace")
    arch = _open(os.fspath(path))[1].get("general.architecture")  # (another writer's order)
    return arch if isinstance(arch, str) else None


_ARCH_KEY = b"general.architecture"


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
    quantization: str | None = "none",
    group_size: int = DEFAULT_INT4_GROUP,
    shard: TensorShard | None = None,
    keep_16_bit: bool = False,
) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    """Config, weights (on `device`; float ones in `dtype`, linear layers in `quantization`,
    None: gguf_default_quantization) and tokenizer of a GGUF model file. The cache keeps one
    entry per quantization mode (and remembers the default, so a hit never parses the file).
    shard: one tensor-parallel rank's weights, its parts of the tensors only (gguf_shard); the
    cache, which holds whole models, is then not used. keep_16_bit: an F16 / BF16 file's
    dense projections, embedding and LM head keep their dtype in 'none' mode (see
    LlamaWeights.to); the cache holds them 16-bit whatever the target."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "no such file")
    if shard is not None and shard.size > 1:
        quantization = quantization or gguf_default_quantization(path)
        config, weights, tokenizer = _convert(path, quantization, group_size, shard)
        return config, weights.to(device, dtype, keep_16_bit), tokenizer
    digest = file_sha256(path) if use_cache else None
    if quantization is None:
        quantization = cached_default(digest) if digest else None
        if quantization is None:
            quantization = gguf_default_quantization(path)
            if digest:
                store_default(digest, quantization)
    kind = "gguf" if quantization == "none" else f"gguf-{quantization}"
    if quantization == "int4":
        kind += f"g{group_size}"
    if digest is not None:
        hit = load_entry(kind, digest, device, dtype, keep_16_bit)
        if hit is not None:
            return hit
    config, weights, tokenizer = _convert(path, quantization, group_size)
    if digest is not None:
        store_entry(kind, digest, config, weights, tokenizer)
    return config, weights.to(device, dtype, keep_16_bit), tokenizer
