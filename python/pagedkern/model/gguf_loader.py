"""Models from GGUF files (llama.cpp's format), read with the `gguf` package.

Quantized tensors are dequantized with gguf.quants.dequantize to fp32, except where they map
straight onto the target format (quantized_linear): Q4_0/Q4_1/Q4_K layer weights onto int4,
Q8_0 onto int8 (layers in int8 mode, the LM head whenever it is int8).
llama.cpp stores the Q
and K projections of "llama" models permuted for its interleaved RoPE (pairs 2i, 2i+1); the
loader undoes that so every model uses rotate-half RoPE (halves i, i + D/2). The converted model
is cached (weights_cache), so only the first load of a file pays for parsing and dequantizing.
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

from .config import FULL, SLIDING, ModelConfig, RopeScaling
from .errors import ModelLoadError
from .gguf_gpt_oss import ARCH as GPT_OSS
from .gguf_gpt_oss import (
    gpt_oss_gguf_fields,
    gpt_oss_gguf_name,
    gpt_oss_gguf_parts,
    gpt_oss_gguf_tensor,
    yarn_from_gguf,
)
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

# arch -> Q/K stored permuted (llama.cpp's converter permutes only its LlamaModel's; Mixtral is
# one, "llama" with expert_count)
_ARCHITECTURES = {
    "llama": True,
    "qwen2": False,
    "qwen3": False,
    "gemma2": False,
    "gemma3": False,
    "qwen2moe": False,
    "qwen3moe": False,
    "olmoe": False,
    GPT_OSS: False,
}
# Mixtures of experts: whether llama.cpp renormalises the top-k weights for an arch whose file
# has no expert_weights_norm (its graph builders hard-code it: Mixtral and Qwen3-MoE do)
_MOE_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
_MOE_NORM_TOPK[GPT_OSS] = False  # (its softmax over the top-k sums to 1 already)
# Gemma: its local:global layer pattern and the layer count of its 27B size, whose attention
# scale llama.cpp takes from hidden / heads instead of the head dim (the GGUF does not store it)
_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma's sandwich norms (HF names as checkpoint_layout.layer_norm_names gives them)
_SANDWICH_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# A MoE layer's tensors (HF names as checkpoint_layout._moe_shapes gives them): the router,
# the shared expert and its gate; the experts' own are slices of one stacked tensor each
# (_EXPERT_NAMES)
_MOE_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",  # stored [H], read [1, H]
}
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def expert_slice(hf_name: str) -> tuple[str, int] | None:
    """(GGUF name of the stacked [E, out, in] tensor, expert index) for one expert's weight,
    model.layers.3.mlp.experts.5.up_proj.weight -> (blk.3.ffn_up_exps.weight, 5), else None."""
    parts = hf_name.split(".")
    if len(parts) != 8 or parts[3:5] != ["mlp", "experts"] or parts[6] not in _EXPERT_NAMES:
        return None
    return f"blk.{parts[2]}.{_EXPERT_NAMES[parts[6]]}.{parts[7]}", int(parts[5])


def gguf_name(hf_name: str, sandwich: bool = False, gpt_oss: bool = False) -> str:
    """HF tensor name -> GGUF name: model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight
    (sandwich: Gemma's norm names; an expert's weight: its stacked tensor, "[e]" appended)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    if (stacked := expert_slice(hf_name)) is not None:
        return f"{stacked[0]}[{stacked[1]}]"
    if gpt_oss and (own := gpt_oss_gguf_name(hf_name)) is not None:
        return own
    _, _, layer, rest = hf_name.split(".", 3)
    if rest in _MOE_NAMES:
        return f"blk.{layer}.{_MOE_NAMES[rest]}"
    if sandwich and rest in _SANDWICH_NAMES:
        return f"blk.{layer}.{_SANDWICH_NAMES[rest]}"
    for hf, gg in _LAYER_NAMES.items():
        if rest.startswith(hf):
            return f"blk.{layer}.{gg}{rest[len(hf) :]}"
    raise KeyError(hf_name)


def _holder(hf_name: str, config: ModelConfig) -> str:
    """The GGUF tensor holding an HF tensor (an expert's: its layer's stack)."""
    stacked = expert_slice(hf_name)
    return stacked[0] if stacked else gguf_name(hf_name, config.sandwich_norms, config.attn_sinks)


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
    elif scaling_type == "yarn":
        scaling = yarn_from_gguf(meta, arch, path)
    elif scaling_type != "none":
        raise ModelLoadError(path, f"unsupported rope scaling type {scaling_type!r}")
    layers = int(get("block_count"))
    gemma = (
        _gemma_fields(meta, arch, layers, hidden, heads, head_dim, path) if arch in _GEMMA else {}
    )
    moe = _moe_fields(meta, arch, tensors, layers, path) if meta.get(f"{arch}.expert_count") else {}
    if arch == GPT_OSS:
        moe |= gpt_oss_gguf_fields(meta, layers, path)
    try:
        config = ModelConfig(
            name=str(meta.get("general.name") or os.path.basename(path)),
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=layers,
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
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            **gemma,
            **moe,
        )
    except ValueError as exc:
        raise ModelLoadError(path, str(exc)) from None
    return config, _ARCHITECTURES[arch]


def _moe_fields(
    meta: dict[str, Any], arch: str, tensors: dict, layers: int, path: str
) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF, read as llama.cpp reads them: expert_count,
    expert_used_count, the experts' size (expert_feed_forward_length, else
    feed_forward_length: Mixtral, OLMoE), the shared expert's (Qwen2-MoE), renormalisation
    (expert_weights_norm, else what llama.cpp's graph for the arch does), and the dense layers:
    those without a router tensor. OLMoE's QK-norm spans the whole projection."""
    if arch not in _MOE_NORM_TOPK:
        raise ModelLoadError(path, f"mixture of experts in a {arch!r} GGUF is not supported")
    used = meta.get(f"{arch}.expert_used_count")
    if used is None:
        raise ModelLoadError(path, f"GGUF metadata lacks {arch}.expert_used_count")
    size = meta.get(f"{arch}.expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length"))
    norm = meta.get(f"{arch}.expert_weights_norm", _MOE_NORM_TOPK[arch])
    return dict(
        num_experts=int(meta[f"{arch}.expert_count"]),
        num_experts_per_tok=int(used),
        moe_intermediate_size=int(size or 0),
        norm_topk_prob=bool(norm),
        shared_expert_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
        dense_layers=tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ),
        qk_norm_whole=arch == "olmoe",
    )


def _gemma_fields(
    meta: dict[str, Any], arch: str, layers: int, hidden: int, heads: int, head_dim: int, path: str
) -> dict[str, Any]:
    """The Gemma fields of a gemma2 / gemma3 GGUF, read as llama.cpp reads them: the sliding
    window (Gemma 2's default 4096), its layer pattern (2 or 6, or the file's
    sliding_window_pattern), Gemma 3's local RoPE base (10000, or the file's freq_base_swa), the
    soft-caps, and the attention scale (the file's attention.scale, else head_dim ** -0.5, but
    (hidden / heads) ** -0.5 at the 27B sizes)."""
    pattern, layers_27b = _GEMMA[arch]
    window = meta.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None)
    if window is None:
        raise ModelLoadError(path, f"GGUF metadata lacks {arch}.attention.sliding_window")
    if int(window) <= 0:
        raise ModelLoadError(path, f"{arch}.attention.sliding_window must be positive")
    swa = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
    if isinstance(swa, list):  # per layer: True = sliding
        sliding = [bool(x) for x in swa]
    else:
        sliding = [(i + 1) % int(swa) != 0 for i in range(layers)]
    if len(sliding) != layers:
        raise ModelLoadError(path, f"{arch}.attention.sliding_window_pattern: not one per layer")
    scale = meta.get(f"{arch}.attention.scale")
    if scale is None:
        scale = (hidden // heads if layers == layers_27b else head_dim) ** -0.5
    keys = {"final_soft_cap": "final_logit_softcapping"}
    if arch == "gemma2":  # (Gemma 3 has no attention soft-cap)
        keys["attn_soft_cap"] = "attn_logit_softcapping"
    caps = {field: meta.get(f"{arch}.{key}") for field, key in keys.items()}
    caps = {field: None if v is None else float(v) for field, v in caps.items()}
    local = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None
    return dict(
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        attn_scale=float(scale),
        sliding_window=int(window),
        layer_types=tuple(SLIDING if s else FULL for s in sliding),
        rope_local_theta=local,
        **caps,
    )


def _convert(
    path: str, quantization: str, group_size: int, shard: TensorShard | None = None
) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    from gguf.quants import dequantize

    reader, meta = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    config, permuted = _config(meta, tensors, path)
    narrow = {}  # a shard's parts are cut from the mapped tensors before anything is read
    experts_narrow = {}  # (gpt-oss's experts, narrowed as read, before their rebuild)
    if shard is not None:
        shard.check(config)
        cut_experts(tensors, config, shard)  # (expert parallel: before the other cuts)
        if config.attn_sinks:
            experts_narrow = cut_tensors(tensors, gpt_oss_gguf_parts(config, shard))
        narrow = shard_tensors(tensors, config, shard, lambda n: _holder(n, config))
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
            direct = None
            if name in int8_tensors or (quantization == "int8" and name not in float_tensors):
                direct = gguf_to_int8(t.tensor_type.name, t.data, n, k)  # Q8_0
            elif quantization == "int4" and group_size == 32 and name not in float_tensors:
                direct = gguf_to_int4(t.tensor_type.name, t.data, n, k)
            if direct is not None:
                return as_experts(direct, outer[0]) if len(outer) == 2 else direct
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
        cut = narrow.get(_holder(hf_name, config))
        return w if w is None or cut is None else narrow_columns(w, *cut, name(hf_name))

    weights = assemble_weights(
        config, get_part, path, "cpu", torch.float32, factors, name, shard=shard
    )
    return config, quantize_weights(weights, quantization, group_size), tokenizer


def gguf_default_quantization(path: str | os.PathLike) -> str:
    """'int4' when every layer weight is a 4-bit block that maps onto int4 without loss
    (Q4_0 / Q4_1 / Q4_K, e.g. the default model), else 'none' (reads the tensor table only);
    a mixture of experts' stacked experts count as layer weights."""
    reader, _ = _open(os.fspath(path))
    kinds = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.")}
    kinds.discard("F32")  # norms
    return "int4" if kinds and kinds <= {"Q4_0", "Q4_1", "Q4_K"} else "none"


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
) -> tuple[ModelConfig, LlamaWeights, Tokenizer]:
    """Config, weights (on `device`; float ones in `dtype`, linear layers in `quantization`,
    None: gguf_default_quantization) and tokenizer of a GGUF model file. The cache keeps one
    entry per quantization mode (and remembers the default, so a hit never parses the file).
    shard: one tensor-parallel rank's weights, its parts of the tensors only (gguf_shard); the
    cache, which holds whole models, is then not used."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "no such file")
    if shard is not None and shard.size > 1:
        quantization = quantization or gguf_default_quantization(path)
        config, weights, tokenizer = _convert(path, quantization, group_size, shard)
        return config, weights.to(device, dtype), tokenizer
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
        hit = load_entry(kind, digest, device, dtype)
        if hit is not None:
            return hit
    config, weights, tokenizer = _convert(path, quantization, group_size)
    if digest is not None:
        store_entry(kind, digest, config, weights, tokenizer)
    return config, weights.to(device, dtype), tokenizer
