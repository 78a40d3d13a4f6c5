"""pagedkern: handwritten CUDA kernels for LLM inference and a compact serving engine on top.

Single kernels:   pagedkern.rms_norm(x, w, eps), pagedkern.silu_and_mul(x), ...  (see `ops`)
Ground truth:     pagedkern.reference.<op> (PyTorch, CPU or CUDA)
Availability:     pagedkern.cuda_available(), pagedkern.cuda_unavailable_reason()
Kernel coverage:  pagedkern.ops.support (outside it: the reference with a warning, or
                  KernelUnsupportedError under ops.set_backend("cuda"))

Ops accept torch tensors and CuPy arrays (or any object with __cuda_array_interface__). CPU torch
tensors run on the reference ops; CUDA arrays run on the kernels, on the caller's current stream.
torch is imported only when torch tensors are used, so CuPy users need no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._extension import CudaUnavailableError, cuda_available, cuda_unavailable_reason
from .ops import (
    KernelUnsupportedError,
    flash_prefill,
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    paged_attention,
    rms_norm,
    rope_and_cache,
    sample,
    silu_and_mul,
)

if TYPE_CHECKING:
    from . import reference

__version__ = "0.1.0"

__all__ = [
    "CudaUnavailableError",
    "KernelUnsupportedError",
    "cuda_available",
    "cuda_unavailable_reason",
    "flash_prefill",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "paged_attention",
    "reference",
    "rms_norm",
    "rope_and_cache",
    "sample",
    "silu_and_mul",
]


def __getattr__(name: str):
    # The reference ops import torch; load them on first use only.
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'pagedkern' has no attribute {name!r}")
