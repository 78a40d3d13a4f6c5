"""Which arguments each op's CUDA kernel covers: one explicit decision per op, `(supported,
reason)`, used by the op's dispatch (ops/launch.py `kernel_or_reference`) and by the engine at
start-up (engine/kernel_policy.py), so the two can never disagree.

Outside kernel support an op on CUDA arrays runs the PyTorch reference under the "auto" backend,
with a warning once per (op, reason): the reference is slow and reads lengths back to the host,
which CUDA-graph capture forbids. Under the "cuda" backend it raises KernelUnsupportedError
naming the op and the reason.
"""

from __future__ import annotations

from typing import NamedTuple

from .arrays import FLOAT_DTYPES

HALF_DTYPES = ("float16", "bfloat16")
FP8_KV_DTYPE = "float8_e4m3fn"  # the fp8 KV cache's element (E4M3)
PAGED_ATTENTION_HEAD_DIMS = (64, 128, 256)
FLASH_PREFILL_HEAD_DIMS = (64, 128, 256)
FLASH_PREFILL_FP8_HEAD_DIMS = (64, 128)  # fp8 (E4M3) caches: not at D = 256 yet
MAX_SAMPLE_VOCAB = (1 << 23) - 1  # fixed-point masses: 2^23 tokens x 2^40 stay below 2^63


class KernelSupport(NamedTuple):
    supported: bool
    reason: str  # why not ("" when supported)


_YES = KernelSupport(True, "")


class KernelUnsupportedError(ValueError):
    """An op was asked to run its CUDA kernel (backend "cuda") on arguments it does not cover."""


def _dtype(dtype: str, allowed: tuple[str, ...]) -> KernelSupport | None:
    if dtype not in allowed:
        return KernelSupport(False, f"dtype {dtype} (the kernel covers {', '.join(allowed)})")
    return None


def _kv_cache(dtype: str, kv_dtype: str | None) -> KernelSupport | None:
    """Caches of the activations' dtype; an fp8 (E4M3) cache: the kernels read and write it for
    float16/bfloat16 activations."""
    if kv_dtype not in (None, dtype, FP8_KV_DTYPE):
        return KernelSupport(
            False, f"a {kv_dtype} KV cache with {dtype} activations (the kernels read caches "
            "of the activations' dtype or fp8)",
        )  # fmt: skip
    if kv_dtype == FP8_KV_DTYPE and dtype not in HALF_DTYPES:
        return KernelSupport(
            False, f"an fp8 (E4M3) KV cache with {dtype} activations (the kernel covers "
            f"{', '.join(HALF_DTYPES)})",
        )  # fmt: skip
    return None


def paged_attention(
    dtype: str, head_dim: int, block_size: int, kv_dtype: str | None = None
) -> KernelSupport:
    """Decode attention: float16/bfloat16, D in {64, 128, 256}, power-of-two block sizes;
    caches of q's dtype or fp8 (kv_dtype FP8_KV_DTYPE)."""
    if bad := _dtype(dtype, HALF_DTYPES):
        return bad
    if head_dim not in PAGED_ATTENTION_HEAD_DIMS:
        return KernelSupport(False, f"head_dim {head_dim} (the kernel covers 64, 128, 256)")
    if block_size <= 0 or block_size & (block_size - 1):
        return KernelSupport(False, f"block_size {block_size} (the kernel needs a power of two)")
    return _kv_cache(dtype, kv_dtype) or _YES


def flash_prefill(dtype: str, head_dim: int, kv_dtype: str | None = None) -> KernelSupport:
    """Prefill attention: float16/bfloat16, D in {64, 128, 256} (256: path 1, 64-row work
    items; not yet verified on a GPU); any block size (path 1); fp8 (E4M3) caches at D 64 and
    128."""
    if bad := _dtype(dtype, HALF_DTYPES):
        return bad
    if head_dim not in FLASH_PREFILL_HEAD_DIMS:
        return KernelSupport(False, f"head_dim {head_dim} (the kernel covers 64, 128, 256)")
    if kv_dtype == FP8_KV_DTYPE and head_dim not in FLASH_PREFILL_FP8_HEAD_DIMS:
        return KernelSupport(
            False, f"head_dim {head_dim} with an fp8 (E4M3) KV cache (the kernel covers 64, 128)"
        )
    return _kv_cache(dtype, kv_dtype) or _YES


# The attention options (reference.attention.ATTENTION_OPTIONS) each attention kernel covers.
ATTENTION_OPTION_NAMES = {
    "sliding_window": "a sliding window",
    "soft_cap": "logit soft-capping",
    "sinks": "attention sinks",
}
KERNEL_ATTENTION_OPTIONS = {
    "paged_attention": ("sliding_window", "soft_cap", "sinks"),  # both variants, every D
    "flash_prefill": ("sliding_window", "soft_cap", "sinks"),  # path 1, 16-bit caches
}


def attention_options(
    kernel: str,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: object = None,
    kv_dtype: str | None = None,
) -> KernelSupport | None:
    """The attention options `kernel` ("paged_attention" or "flash_prefill") lacks: a decision
    against it naming them when one of them is set, else None (the kernel takes the rest).
    flash_prefill's options kernel reads 16-bit caches: with an fp8 kv_dtype none is covered."""
    given = {"sliding_window": sliding_window, "soft_cap": soft_cap, "sinks": sinks}
    if (
        kernel == "flash_prefill"
        and kv_dtype == FP8_KV_DTYPE
        and any(v is not None for v in given.values())
    ):
        return KernelSupport(
            False, "attention options with an fp8 (E4M3) KV cache (the prefill kernel's "
            "options read 16-bit caches)",
        )  # fmt: skip
    covered = KERNEL_ATTENTION_OPTIONS[kernel]
    used = [
        ATTENTION_OPTION_NAMES[name]
        for name, value in given.items()
        if value is not None and name not in covered
    ]
    if not used:
        return None
    return KernelSupport(False, f"{', '.join(used)} (not in the kernel yet)")


def sample(dtype: str, vocab: int) -> KernelSupport:
    """Sampling: float32/float16/bfloat16 logits, vocabularies below 2^23."""
    if bad := _dtype(dtype, FLOAT_DTYPES):
        return bad
    if vocab > MAX_SAMPLE_VOCAB:
        return KernelSupport(False, f"vocabulary of {vocab} (the kernel covers < 2^23 entries)")
    return _YES


def rejection_sample(dtype: str, vocab: int) -> KernelSupport:
    """Speculative verification: float32 probabilities, vocabularies below 2^23."""
    if bad := _dtype(dtype, ("float32",)):
        return bad
    if vocab > MAX_SAMPLE_VOCAB:
        return KernelSupport(False, f"vocabulary of {vocab} (the kernel covers < 2^23 entries)")
    return _YES


def elementwise(dtype: str) -> KernelSupport:
    """rms_norm, fused_add_rms_norm, the gated activations, rope_and_cache: every float dtype,
    any shape their validation accepts."""
    return _dtype(dtype, FLOAT_DTYPES) or _YES


MAX_QK_NORM_HEAD_DIM = 512  # csrc/rope_and_cache.cu: 8 pairs per lane of a warp


def rope_and_cache(
    dtype: str, kv_dtype: str | None = None, qk_norm_head_dim: int | None = None
) -> KernelSupport:
    """RoPE + cache write: every float dtype into a cache of that dtype; an fp8 (E4M3) cache
    for float16/bfloat16 q, k, v; QK-norm fused (qk_norm_head_dim: the head dim, when the
    op normalises q and k) for head dims up to 512."""
    if qk_norm_head_dim is not None and qk_norm_head_dim > MAX_QK_NORM_HEAD_DIM:
        return KernelSupport(
            False, f"QK-norm over head_dim {qk_norm_head_dim} (the kernel covers <= 512)"
        )
    return _kv_cache(dtype, kv_dtype) or elementwise(dtype)


# The ops of a decode step's forward pass: all of them are captured in its CUDA graphs.
MOE_MAX_EXPERTS = 512  # csrc/moe.h kMoeMaxExperts (shared-memory tables)


def fused_moe(dtype: str, experts: int | None = None) -> KernelSupport:
    """The MoE MLP (csrc/moe_route.cu, csrc/moe_gemm.cu): float16/bfloat16 activations and
    experts, up to 512 experts, any T, H, I and top_k <= E; softmax or sigmoid routing, silu
    or gelu_tanh; gpt-oss's softmax over the top-k, expert biases and clamped SwiGLU. Not in
    the kernel: float32, quantized experts."""
    if bad := _dtype(dtype, HALF_DTYPES):
        return bad
    if experts is not None and experts > MOE_MAX_EXPERTS:
        return KernelSupport(False, f"{experts} experts (the kernel covers up to 512)")
    return _YES


def fused_moe_quantized(
    dtype: str, experts: int, fmt: str, group_size: int, hidden: int, inter: int, activation: str
) -> KernelSupport:
    """The MoE MLP over stacked quantized experts (csrc/moe_gemm_quant.cu): fused_moe's cover,
    int4 (G = 32 or 128) or int8 experts with H and I multiples of 32 and of G, silu or
    gelu_tanh."""
    base = fused_moe(dtype, experts)
    if not base.supported:
        return base
    multiple = group_size if fmt == "int4" else 32
    if fmt == "int4" and group_size not in (32, 128):
        return KernelSupport(False, f"int4 experts with group size {group_size} (32 or 128)")
    if fmt == "int8" and group_size:
        return KernelSupport(
            False, f"int8 experts with a scale per {group_size} (per channel only)"
        )
    if hidden % multiple or inter % multiple or multiple % 32:
        return KernelSupport(False, f"H {hidden} and I {inter} not multiples of {multiple}")
    if activation not in ("silu", "gelu_tanh"):
        return KernelSupport(False, f"activation {activation!r} over quantized experts")
    return _YES


def moe_route(experts: int) -> KernelSupport:
    """The router alone: logits of every float dtype, up to 512 experts."""
    if experts > MOE_MAX_EXPERTS:
        return KernelSupport(False, f"{experts} experts (the kernel covers up to 512)")
    return _YES


DECODE_GRAPH_OPS = ("rms_norm", "silu_and_mul", "rope_and_cache", "paged_attention", "fused_moe")


def model_support(
    dtype: str,
    head_dim: int,
    block_size: int,
    vocab: int,
    kv_dtype: str | None = None,
    attention: dict | None = None,
    moe: bool = False,
) -> dict[str, KernelSupport]:
    """The decision of every op a Llama forward pass and its sampling launch, for one model and
    cache configuration (dtype as a name: "bfloat16", ...; kv_dtype: the cache's, None = dtype;
    attention: the attention options some layer uses, as attention_options' keywords; moe:
    whether some layer is a mixture of experts)."""
    decode_options = attention_options("paged_attention", **(attention or {}))
    prefill_options = attention_options("flash_prefill", **(attention or {}), kv_dtype=kv_dtype)
    moe_layers = {"fused_moe": fused_moe(dtype)} if moe else {}
    return moe_layers | {
        "rms_norm": elementwise(dtype),
        "silu_and_mul": elementwise(dtype),
        "rope_and_cache": rope_and_cache(dtype, kv_dtype),
        "paged_attention": decode_options or paged_attention(dtype, head_dim, block_size, kv_dtype),
        "flash_prefill": prefill_options or flash_prefill(dtype, head_dim, kv_dtype),
        "sample": sample("float32", vocab),  # the engine samples fp32 logits
    }
