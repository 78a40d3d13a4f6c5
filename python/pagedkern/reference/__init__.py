"""PyTorch reference implementations of every pagedkern op: the ground truth for the kernels.

Device-agnostic (CPU or CUDA tensors), same signatures as `pagedkern.ops`, semantics fixed in the
docstrings. Written for clarity, not speed; the CPU serving path runs on them.
"""

from .activation import silu_and_mul
from .attention import flash_prefill, merge_attention_states, paged_attention
from .norm import fused_add_rms_norm, rms_norm
from .rope import cos_sin_cache, rope_and_cache
from .sampling import philox4x32, sample

__all__ = [
    "cos_sin_cache",
    "flash_prefill",
    "fused_add_rms_norm",
    "merge_attention_states",
    "paged_attention",
    "philox4x32",
    "rms_norm",
    "rope_and_cache",
    "sample",
    "silu_and_mul",
]
