"""The public kernel API: one entry per op. Each validates its arguments (TypeError/ValueError
naming the argument, its shape and dtype), then runs the CUDA kernel on CUDA arrays (caller's
current stream) or the PyTorch reference on CPU tensors; what each kernel covers is decided in
support.py (outside it: the reference with a warning, or KernelUnsupportedError under the strict
"cuda" backend)."""

from .activation import gelu_tanh_and_mul, silu_and_mul
from .flash_prefill import flash_prefill
from .launch import get_backend, set_backend, use_backend
from .moe import fused_moe
from .norm import fused_add_rms_norm, rms_norm
from .paged_attention import paged_attention
from .rejection_sampling import rejection_sample
from .rope import rope_and_cache
from .sampling import sample
from .support import KernelSupport, KernelUnsupportedError

__all__ = [
    "flash_prefill",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "KernelSupport",
    "KernelUnsupportedError",
    "get_backend",
    "paged_attention",
    "quant_linear",
    "rejection_sample",
    "rms_norm",
    "rope_and_cache",
    "sample",
    "set_backend",
    "silu_and_mul",
    "use_backend",
]


def __getattr__(name: str):
    # quant_linear works on torch tensors (QuantizedWeight) and imports torch: loaded on first
    # use, so `import pagedkern` stays torch-free for CuPy users.
    if name == "quant_linear":
        from .quant_gemm import quant_linear

        globals()[name] = quant_linear
        return quant_linear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
