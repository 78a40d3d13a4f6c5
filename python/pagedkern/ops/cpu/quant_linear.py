"""The CPU backend's quant_linear: the int8-activation GEMV/GEMM of csrc/cpu/quant_gemv.cpp
(ops/cpu/quant_gemv.py) at every M, fp32 out, rounded once to x's dtype. Measured faster than
torch's int-pack kernels at every M tried (1 to 512, SmolLM2-135M's shapes and its 49152-row
LM head: 1.4-5x, docs/guides/cpu-backend.md), so there is no crossover to switch at; one
kernel at every M also keeps a row's result independent of its batch (decode rows alone or
beside a prefill chunk). Without the built module: torch's int-pack kernels (bf16 activations),
with a warning once."""

from __future__ import annotations

import warnings

import torch

from ...reference.quantized_weight import QuantizedWeight
from . import quant_gemv
from .int_pack import torch_int_pack_mm

_warned = False


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float CPU -> x @ W.T (+ bias) [M, N] in x's dtype (arguments validated by
    ops.quant_linear)."""
    if not quant_gemv.available():
        global _warned
        if not _warned:
            warnings.warn(quant_gemv.unavailable_reason(), RuntimeWarning, stacklevel=2)
            _warned = True
        out = torch_int_pack_mm(x, weight)
    else:
        out = quant_gemv.quant_gemv(x.float(), weight)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)
