"""Engine settings: which model, where it runs, how big the KV cache is, batching limits.

The one place for their defaults and help texts: `SchedulerConfig` is built from an EngineConfig,
and the CLI derives its engine flags (default and help) from `engine_fields()`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.kv_cache import KV_CACHE_DTYPES
from .validation import (
    INT32_MAX,
    ParameterTypeError,
    check_bool,
    check_int,
    check_number,
)

BACKENDS = ("auto", "cuda", "cpu", "reference")
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


SPECULATIVE_METHODS = ("none", "ngram", "draft")


def _setting(default: Any, help: str, cli: dict | None = None, **kw) -> Any:  # noqa: A002
    """A field with its help text (argparse's word) and, for fields whose flag the CLI derives
    from the field alone, `cli`: the flag's argparse keywords (type check, choices)."""
    metadata = {"help": help} if cli is None else {"help": help, "cli": cli}
    return field(default=default, metadata=metadata, **kw)


@dataclass(slots=True)
class EngineConfig:
    """Validated on construction: a ValueError (ParameterTypeError for a wrong type) names the
    field. See each field's help (`engine_fields()`) for its meaning."""

    model: str | None = _setting(
        None, 'GGUF file, HF folder or "synthetic:<preset>" (default: SmolLM2-135M-Instruct GGUF)'
    )
    backend: str = _setting(
        "auto",
        "auto: CUDA kernels when a GPU is usable, else the CPU backend; cuda: insist on the "
        "kernels; cpu: the CPU backend (ops/cpu: C++ attention, quantized GEMMs, decoder and "
        "sampling; torch or the reference for other ops) on the CPU; reference: PyTorch "
        "reference ops everywhere (on the GPU if there is one)",
        cli={"choices": BACKENDS},
    )
    device: str | None = _setting(None, "torch device (default: picked from the backend)")
    dtype: torch.dtype | str | None = _setting(
        None, "weights and KV cache dtype: float32, float16, bfloat16 (default: the model's)"
    )
    block_size: int = _setting(16, "tokens per KV cache block")
    num_blocks: int | None = _setting(
        None, "KV cache blocks (default: from --gpu-memory-fraction or --kv-cache-gib)"
    )
    kv_cache_gib: float = _setting(1.0, "KV cache size in GiB on the CPU")
    gpu_memory_fraction: float = _setting(
        0.85, "fraction of GPU memory for weights, activations and the KV cache"
    )
    max_num_seqs: int = _setting(64, "most requests in one batch")
    max_num_batched_tokens: int = _setting(2048, "most tokens in one forward pass")
    max_model_len: int | None = _setting(
        None, "context length in tokens (default: the model's; capped by the KV cache)"
    )
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _setting(
        True, "split long prompts into chunks that share steps with decodes"
    )
    kv_per_kind_tables: bool = _setting(
        True,
        "hybrid local/global models (Gemma 2/3): a block table per layer kind, the sliding "
        "layers keeping only their window's KV blocks (off under tensor parallelism and "
        "draft-model speculation)",
    )
    cuda_graphs: bool | None = _setting(
        None,
        "replay decode steps from CUDA graphs (default: where the kernels run on a GPU; True on "
        "the CPU runs the same padded static-buffer path eagerly, for tests)",
    )
    piecewise_cuda_graphs: bool | None = _setting(
        None,
        "replay mixed (prefill + decode) steps from per-layer CUDA graphs with attention eager "
        "between them; none: wherever decode CUDA graphs are on",
        cli={"action": argparse.BooleanOptionalAction},
    )
    seed: int = _setting(0, "seed of synthetic weights")
    max_queue: int = _setting(
        256, "requests that may wait for a batch slot before the HTTP server answers 429"
    )
    grammar_compile_timeout: float = _setting(
        10.0,
        "seconds the HTTP engine core lets one response_format schema compile (on its own "
        "threads, off the step loop); longer: a 400 naming response_format",
        cli={"type": "positive_float"},
    )
    grammar_compile_workers: int = _setting(
        2,
        "threads of the HTTP engine core that compile response_format schemas at once (more "
        "wait their turn)",
        cli={"type": "positive_int"},
    )
    quantization: str | None = _setting(
        None,
        "weight-only quantization: none, int8 (per channel) or int4 (groups of 32); a GGUF's "
        "Q8_0 / Q6_K tensors stay int8 with their block scales in both (default: on the CPU "
        "the GGUF's own precision: int4 with 4-bit layers, int8 with Q8_0 / Q6_K ones; else none)",
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "KV cache dtype: auto (the model's dtype; float16 for float32 activations on the CPU), "
        "fp8 (E4M3, per-layer scales), bfloat16 / float16 (K and V of float32 activations "
        "rounded to nearest: half the bytes), or float32 (float32 activations' exact K and V)",
    )
    async_scheduling: bool = _setting(
        False,
        "overlap scheduling with execution: while step N runs on the engine's worker thread, "
        "schedule and lay out step N+1 with N's sampled tokens as placeholders (engine/"
        "overlap.py; off by default: not yet verified on a GPU)",
        cli={"action": "store_true"},
    )
    shadow: str | bool | None = _setting(
        None,
        "shadow mode: on runs every op's PyTorch reference beside it and reports the worst "
        "error per op and layer (--stats, /metrics); strict stops at the first divergence; "
        "slow, for verification (default: PAGEDKERN_SHADOW, else off)",
        cli={"nargs": "?", "const": "on", "choices": ("off", "on", "strict")},
    )
    tensor_parallel_size: int = _setting(
        1,
        "ranks the model is split over (torch.distributed: gloo on the CPU, NCCL on CUDA); "
        "rank 0 is this process, ranks 1..N-1 workers it spawns (or torchrun starts)",
    )
    expert_parallel: bool = _setting(
        False,
        "MoE models over tensor_parallel_size N ranks: each rank holds E/N whole experts (the "
        "first E mod N ranks one more) instead of a slice of every expert; tokens go to their "
        "experts' ranks and back by all-to-all; attention, dense MLPs and the router stay "
        "tensor-parallel (a no-op for dense models, as in vLLM; needs N > 1)",
        cli={"action": "store_true"},
    )
    # Speculative decoding (engine/speculative/): propose k tokens cheaply, verify them in one
    # forward pass of the target model.
    speculative: str = _setting(
        "none",
        "speculative decoding: none, ngram (prompt lookup) or draft (a smaller model, "
        "--draft-model)",
        cli={"choices": SPECULATIVE_METHODS},
    )
    num_speculative_tokens: int = _setting(
        4, "tokens proposed (and verified) per speculative step", cli={"type": "positive_int"}
    )
    ngram_min: int = _setting(
        2, "shortest suffix n-gram that n-gram lookup matches", cli={"type": "positive_int"}
    )
    ngram_max: int = _setting(
        4, "longest suffix n-gram that n-gram lookup matches", cli={"type": "positive_int"}
    )
    draft_model: str | None = _setting(
        None,
        'the draft model of --speculative draft: a GGUF file, HF folder, "synthetic:<preset>" '
        'or "self:N" (the target\'s first N layers with its final norm and LM head)',
        cli={},
    )

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ParameterTypeError(f"model must be a string or None, got {self.model!r}")
        if self.quantization not in (None, "none", "int8", "int4"):
            raise ValueError(f"quantization must be none, int8 or int4, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.device is not None:
            _check_device(self.device, self.backend)
        self.dtype = _dtype(self.dtype)
        check_int("block_size", self.block_size, 1, 1 << 16)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1, INT32_MAX)
        if check_number("kv_cache_gib", self.kv_cache_gib) <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        fraction = check_number("gpu_memory_fraction", self.gpu_memory_fraction)
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
        check_int("max_num_seqs", self.max_num_seqs, 1, INT32_MAX)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, INT32_MAX)
        if self.max_model_len is not None:  # 0 is not "the default": None is
            check_int("max_model_len", self.max_model_len, 1, INT32_MAX)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_bool("kv_per_kind_tables", self.kv_per_kind_tables)
        if self.cuda_graphs is not None:
            check_bool("cuda_graphs", self.cuda_graphs)
        if self.piecewise_cuda_graphs is not None:
            check_bool("piecewise_cuda_graphs", self.piecewise_cuda_graphs)
        check_int("seed", self.seed, 0, 2**63 - 1)
        check_int("max_queue", self.max_queue, 1, INT32_MAX)
        if check_number("grammar_compile_timeout", self.grammar_compile_timeout) <= 0:
            raise ValueError(
                f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}"
            )
        check_int("grammar_compile_workers", self.grammar_compile_workers, 1, 1024)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1024)
        check_bool("expert_parallel", self.expert_parallel)
        check_bool("async_scheduling", self.async_scheduling)
        self.shadow = _shadow(self.shadow)
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be none, ngram or draft, got {self.speculative!r}")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        check_int("ngram_min", self.ngram_min, 1, 64)
        check_int("ngram_max", self.ngram_max, 1, 64)
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise ParameterTypeError(f"draft_model must be a string, got {self.draft_model!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative draft needs draft_model (a model path or self:N)")
        if self.async_scheduling and self.speculative != "none":
            raise ValueError(
                "async_scheduling cannot be combined with speculative decoding (a proposal "
                "needs the previous step's tokens on the host)"
            )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1")

    def model_spec(self):
        """The model.ModelSpec these settings load (what TP workers and drafts load too)."""
        return _model_spec(self)


def _model_spec(config: EngineConfig):
    from ..model.spec import ModelSpec

    return ModelSpec(
        model=config.model,
        dtype=config.dtype,
        seed=config.seed,
        max_positions=config.max_model_len,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        backend=config.backend,
    )


def _shadow(value) -> str | None:
    """off / on / strict; True and False as on and off; None (PAGEDKERN_SHADOW) stays None."""
    if value is None:
        return None
    if value is True or value is False:
        return "on" if value else "off"
    if value not in ("off", "on", "strict"):
        raise ValueError(f"shadow must be off, on or strict, got {value!r}")
    return value


def _check_device(device, backend: str) -> None:
    """A device torch can name, of a type the engine runs on, that the backend can use: checked
    here so a mismatch is refused before a model loads, not after."""
    if not isinstance(device, (str, torch.device)):
        raise ParameterTypeError(f"device must be a string or None, got {device!r}")
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {str(device)!r}")
    if backend == "cuda" and kind != "cuda":
        raise ValueError(f"backend 'cuda' runs the CUDA kernels only, but device is {kind}")
    if backend == "cpu" and kind != "cpu":
        raise ValueError(f"backend 'cpu' runs on the CPU only, but device is {kind}")


def _dtype(value) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {value}")
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {value!r}")


@dataclass(frozen=True, slots=True)
class ConfigField:
    """One EngineConfig field as a command line flag needs it."""

    name: str
    default: Any
    help: str
    cli: dict | None = None  # argparse keywords where the CLI derives the flag from the field

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def engine_fields() -> dict[str, ConfigField]:
    """Every EngineConfig field by name, with its default and help text (for the CLI)."""
    return {
        f.name: ConfigField(f.name, f.default, f.metadata.get("help", ""), f.metadata.get("cli"))
        for f in dataclasses.fields(EngineConfig)
    }
