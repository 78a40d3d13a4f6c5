"""The CPU backend's quant_linear, by the `cpu_quant_linear` kernel variant (ops/variants.py):
- `int_pack` (default): torch's int-pack kernels, bf16 activations.
- `int8_activations`: the GEMV/GEMM of csrc/cpu/quant_gemv.cpp (ops/cpu/quant_gemv.py) at every
  M, activations quantized to int8 per block of 32, fp32 out, rounded once to x's dtype.
  Measured faster than torch's int-pack kernels at every M tried (1 to 512, SmolLM2-135M's
  shapes and its 49152-row LM head: 1.4-5x, docs/guides/cpu-backend.md), so there is no
  crossover to switch at; one kernel at every M also keeps a row's result independent of its
  batch. Not the default: its ~1% error a GEMM (the int8 activations, exactly what the kernel
  means to compute) turns the default int4 model's answer to "What is the capital of France?"
  from Paris to a list of French words. Without the built module it falls back to int_pack,
  with a warning once."""

from __future__ import annotations

import warnings

import torch

from ...reference.quantized_weight import QuantizedWeight
from .. import variants
from . import quant_gemv
from .int_pack import torch_int_pack_mm

_warned = False


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float CPU -> x @ W.T (+ bias) [M, N] in x's dtype (arguments validated by
    ops.quant_linear)."""
    if variants.selected("cpu_quant_linear") == "int_pack":
        out = torch_int_pack_mm(x, weight)
    elif not quant_gemv.available():
        global _warned
        if not _warned:
            warnings.warn(quant_gemv.unavailable_reason(), RuntimeWarning, stacklevel=2)
            _warned = True
        out = torch_int_pack_mm(x, weight)
    else:
        out = quant_gemv.quant_gemv(x.float(), weight)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)
