"""A GGUF's metadata as a ModelConfig, read the way llama.cpp reads it: the architectures
pagedkern loads (and whether llama.cpp stored their Q/K permuted), RoPE scaling, the mixture of
experts fields (expert counts, sizes, renormalisation, dense layers) and Gemma's (window, layer
pattern, local RoPE base, soft-caps, attention scale); gpt-oss's in gguf_gpt_oss."""

from __future__ import annotations

import os
from typing import Any

from .config import FULL, SLIDING, ModelConfig, RopeScaling
from .config_checks import check_types
from .errors import ModelLoadError
from .gguf_gpt_oss import ARCH as GPT_OSS
from .gguf_gpt_oss import gpt_oss_gguf_fields, yarn_from_gguf

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
# The types of the "<arch>." keys the reader takes (config_checks)
_KINDS = dict.fromkeys(
    ("block_count", "embedding_length", "feed_forward_length", "context_length",
     "attention.head_count", "attention.head_count_kv", "attention.key_length",
     "attention.value_length", "rope.dimension_count", "rope.scaling.original_context_length"),
    "size",
)  # fmt: skip
_KINDS |= dict.fromkeys(
    ("expert_count", "expert_used_count", "expert_feed_forward_length",
     "expert_shared_feed_forward_length", "attention.sliding_window"),
    "count",
)  # fmt: skip
_KINDS |= dict.fromkeys(
    ("rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon",
     "rope.scaling.factor", "attention.scale", "attn_logit_softcapping",
     "final_logit_softcapping", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"),
    "number",
)  # fmt: skip
_KINDS |= {"rope.scaling.type": "str", "expert_weights_norm": "bool"}


def config_from_gguf(meta: dict[str, Any], tensors: dict, path: str) -> tuple[ModelConfig, bool]:
    """(config, whether the file stores Q and K permuted) of a GGUF's metadata and tensor table
    (name -> ReaderTensor); errors name the file and the missing or unsupported field."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in _ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(_ARCHITECTURES)})"
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(path, "tensor 'token_embd.weight' is missing")
    if len(tensors["token_embd.weight"].shape) != 2:  # (its rows give the vocabulary size)
        raise ModelLoadError(path, "tensor 'token_embd.weight' is not a matrix")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {arch}.{key}")
        return value

    check_types(meta, _KINDS, path, prefix=f"{arch}.")
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(path, "partial rotary embeddings are not supported")
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(path, "value heads of another size than key heads: not supported")
    layers = int(get("block_count"))
    _check_counts(meta, arch, tensors, layers, path)
    gemma = (
        _gemma_fields(meta, arch, layers, hidden, heads, head_dim, path) if arch in _GEMMA else {}
    )
    moe = _moe_fields(meta, arch, tensors, layers, path) if meta.get(f"{arch}.expert_count") else {}
    if arch == GPT_OSS:
        moe |= gpt_oss_gguf_fields(meta, layers, path)
    try:
        scaling = None
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
        elif scaling_type == "yarn":
            scaling = yarn_from_gguf(meta, arch, path)
        elif scaling_type != "none":
            raise ModelLoadError(path, f"unsupported rope scaling type {scaling_type!r}")
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


def _check_counts(meta: dict[str, Any], arch: str, tensors: dict, layers: int, path: str) -> None:
    """Refuse a block_count or expert_count past the file's tensors, before expected_shapes
    lists every tensor of every layer and expert (10^9 layers: a MemoryError)."""
    if not any(name.startswith(f"blk.{layers - 1}.") for name in tensors):
        problem = (
            f"{arch}.block_count is {layers}, but the file has no tensor of layer {layers - 1}"
        )
        raise ModelLoadError(path, problem)
    experts = meta.get(f"{arch}.expert_count") or 0
    router = next((t for name, t in tensors.items() if name.endswith("ffn_gate_inp.weight")), None)
    if experts and router is not None and len(router.shape) == 2 and router.shape[1] != experts:
        # (a router's rows, GGUF dims reversed: one per expert)
        problem = f"{arch}.expert_count is {experts}, but the router has {router.shape[1]} rows"
        raise ModelLoadError(path, problem)


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
    elif isinstance(swa, int) and not isinstance(swa, bool) and swa > 0:
        sliding = [(i + 1) % swa != 0 for i in range(layers)]
    else:
        raise ModelLoadError(path, f"{arch}.attention.sliding_window_pattern: invalid {swa!r}")
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
