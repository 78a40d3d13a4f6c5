"""Engine settings: which model, where it runs, how big the KV cache is, batching limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EngineConfig:
    """model: None (default SmolLM2 GGUF), a .gguf path, a HF folder or "synthetic:<preset>".
    backend: "auto" (CUDA kernels when a GPU is usable, else the CPU reference), "cuda"
    (insist on the kernels), "reference" (PyTorch reference ops, on the GPU if there is one).
    KV cache: num_blocks if given; else on the GPU what gpu_memory_fraction of the device's
    memory leaves after the weights and a profiled forward pass, on the CPU kv_cache_gib.
    cuda_graphs: replay decode steps from CUDA graphs (None: wherever the kernels run on a GPU;
    True on the CPU runs the same padded static-buffer path eagerly, for tests)."""

    model: str | None = None
    backend: str = "auto"
    device: str | None = None  # None: picked from the backend
    dtype: torch.dtype | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gib: float = 1.0
    gpu_memory_fraction: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cuda_graphs: bool | None = None  # None: on for the CUDA kernels on a GPU
    seed: int = 0  # synthetic weights
    # Weight-only quantization: "none" / "int8" / "int4"; None: the model's measured default.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the activation dtype; "fp8": E4M3, per-layer scales

    def __post_init__(self) -> None:
        if self.quantization not in (None, "none", "int8", "int4"):
            raise ValueError(f"quantization must be none, int8 or int4, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.backend not in ("auto", "cuda", "reference"):
            raise ValueError(f"backend must be auto, cuda or reference, got {self.backend!r}")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be positive")
        if not 0 < self.gpu_memory_fraction <= 1 or self.kv_cache_gib <= 0:
            raise ValueError("gpu_memory_fraction must be in (0, 1] and kv_cache_gib positive")
