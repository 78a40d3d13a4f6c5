"""The CPU backend's quant_linear, by the `cpu_quant_linear` kernel variant (ops/variants.py):
- `int16_activations` (default): the GEMV/GEMM of csrc/cpu/ (ops/cpu/quant_gemv.py) at every
  M, activations quantized to 16 bits per block of 32, fp32 out, rounded once to x's dtype.
  Faster than torch's int-pack kernels at every M measured (SmolLM2-135M's shapes and its
  49152-row LM head, bench/test_bench_cpu_quant_gemv.py), so there is no crossover to switch
  at; one kernel at every M also keeps a row's result independent of its batch. Its error a
  GEMM is ~1e-5 relative: below bf16 activations' (int_pack) and llama.cpp's int8 ones.
- `int_pack`: torch's int-pack kernels, bf16 activations.
- `int8_activations`: the same C++ GEMM with llama.cpp's int8 activations (~0.5-1% error a
  GEMM; on the default model it answers as llama.cpp does, which differs from the fp32
  reference's answer where that is a near tie).
Without the built module the C++ variants fall back to int_pack, with a warning once."""

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
    variant = variants.selected("cpu_quant_linear")
    if variant == "int_pack":
        out = torch_int_pack_mm(x, weight)
    elif not quant_gemv.available():
        global _warned
        if not _warned:
            warnings.warn(quant_gemv.unavailable_reason(), RuntimeWarning, stacklevel=2)
            _warned = True
        out = torch_int_pack_mm(x, weight)
    else:
        bits = 8 if variant == "int8_activations" else 16
        out = quant_gemv.quant_gemv(x.float(), weight, activation_bits=bits)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


def for_step():
    """quant_linear with the variant and the C++ GEMM's ISA path resolved once, for the calls of
    one forward step (the model's CPU-backend op table): the same function, without reading
    PAGEDKERN_KERNELS and probing the module at each of its ~120 GEMMs."""
    variant = variants.selected("cpu_quant_linear")
    if variant == "int_pack" or not quant_gemv.available():
        return quant_linear
    bits = 8 if variant == "int8_activations" else 16
    path = quant_gemv.best_path()
    gemv = quant_gemv.quant_gemv

    def linear(
        x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = gemv(x.float(), weight, path=path, activation_bits=bits).to(x.dtype)
        return out if bias is None else out.add_(bias)

    return linear
