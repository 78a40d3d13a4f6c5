"""PyTorch reference implementations of every pagedkern op: the ground truth for the kernels.

Device-agnostic (CPU or CUDA tensors), same signatures as `pagedkern.ops`, semantics fixed in the
docstrings. Written for clarity, not speed; the CPU serving path runs on them.
"""

from .activation import gelu_tanh_and_mul, silu_and_mul
from .attention import flash_prefill, merge_attention_states, paged_attention
from .moe import fused_moe, moe_route
from .norm import fused_add_rms_norm, rms_norm
from .rejection_sampling import rejection_sample
from .rope import cos_sin_cache, rope_and_cache
from .sampling import philox4x32, sample, sampling_distribution

__all__ = [
    "cos_sin_cache",
    "flash_prefill",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "merge_attention_states",
    "moe_route",
    "paged_attention",
    "philox4x32",
    "rejection_sample",
    "rms_norm",
    "rope_and_cache",
    "sample",
    "sampling_distribution",
    "silu_and_mul",
]
