"""The CPU backend: per op, the implementation that runs on CPU tensors under the "cpu" backend
(and "auto" on the CPU). An op has one here where a faster one than the reference exists, tested
against the reference as the CUDA kernels are (tests/test_cpu_backend*.py); every other op runs
the reference, and says so in IMPLEMENTATIONS: the one table of what the backend runs."""

from __future__ import annotations

from types import SimpleNamespace

from ... import reference
from . import (
    activation,
    attention,
    dense_linear,
    embedding,
    moe,
    norm,
    quant_linear,
    rope,
    sampling,
)

# op -> its CPU implementation; the reference's own function where the CPU has no faster one
IMPLEMENTATIONS = {
    "flash_prefill": attention.flash_prefill,  # the C++ kernel (tiles: cpu_attention:tiles)
    "paged_attention": attention.paged_attention,  # the same, one-token chunks
    "rms_norm": norm.rms_norm,
    "fused_add_rms_norm": norm.fused_add_rms_norm,
    "silu_and_mul": activation.silu_and_mul,  # fp32: one silu, one in-place multiply
    "gelu_tanh_and_mul": reference.gelu_tanh_and_mul,
    "rope_and_cache": rope.rope_and_cache,  # fp32: one C++ call; else per-step RoPE rows
    "fused_moe": moe.fused_moe,  # the GEMMs grouped over all experts, one call each
    "sample": sampling.sample,  # the C++ rows (reference: cpu_sample:reference)
    "rejection_sample": reference.rejection_sample,
    "quant_linear": quant_linear.quant_linear,  # the C++ GEMV / GEMM (csrc/cpu/gemv.cpp)
}

# What ops receive from launch.host_ops: the table's functions as attributes
implementations = SimpleNamespace(**{op: f for op, f in IMPLEMENTATIONS.items() if f is not None})


def step_implementations() -> SimpleNamespace:
    """`implementations` for the calls of one forward step whose arguments the caller vouches
    for (the model's own tensors): quant_linear and dense_linear with their variants and GEMM
    paths resolved once, and dequantize_rows(weight, ids, dtype), the embedding lookup from a
    quantized table."""
    table = SimpleNamespace(**vars(implementations))
    table.quant_linear = quant_linear.for_step()
    table.dense_linear = dense_linear.for_step()
    table.dequantize_rows = embedding.dequantize_rows
    return table


def implementation_of(op: str):
    """The function `op` runs on the CPU backend (KeyError for an op outside the table)."""
    return IMPLEMENTATIONS[op]
