"""The model's GEMMs: a linear layer over plain or quantized weights, and the LM head's
projection to float32 logits."""

from __future__ import annotations

import torch

from .. import ops
from ..ops import launch
from ..ops.cpu.dense_linear import blas_linear, dense_linear
from .quantized_linear import QuantizedWeight
from .weights import Linear

_mm_out_dtype_works: bool | None = None  # torch.mm(..., out_dtype=) on CUDA, probed once


def linear(x: torch.Tensor, weight: Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: ops.quant_linear for quantized weights; float weights on the CPU
    backend its fixed-order GEMM (ops/cpu/dense_linear.py), else torch's GEMM."""
    launch.record_launch("gemm")
    if isinstance(weight, QuantizedWeight):
        return ops.quant_linear(x, weight, bias)
    return _float_linear(x, weight, bias)


def _float_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for float weights: the CPU backend's fixed-order GEMM, else
    torch's (a 16-bit weight under fp32 x widened)."""
    if launch.on_cpu_backend(x.device):
        return dense_linear(x, weight, bias)
    return blas_linear(x, weight, bias)


def mm_fp32_out(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """h @ weight.T as fp32 straight from a half-precision GEMM (CUDA, recent torch), or None."""
    global _mm_out_dtype_works
    if not h.is_cuda or _mm_out_dtype_works is False:
        return None
    try:
        out = torch.mm(h, weight.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        _mm_out_dtype_works = False
        return None
    _mm_out_dtype_works = True
    return out


class LogitsProjection:
    """[N, H] final hidden states -> [N, vocab] float32 logits through an LM head.

    Logits rounded to bf16 (spacing 0.125 near 25) turn close calls into ties, so half-precision
    models get an fp32-output GEMM where torch has one (CUDA), else a GEMM against an fp32 copy
    of the head (V*H*4 bytes, made on first use: one head per model). A quantized head gives
    bf16 logits (measured: see README), widened."""

    def __init__(self, soft_cap: float | None = None):
        self.soft_cap = soft_cap  # (Gemma 2) the final logits' soft cap
        self._head_fp32: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, head: Linear, table=None) -> torch.Tensor:
        """table: a step's op table, whose quant_linear and dense_linear run (a step's own
        tensors); default: ops.quant_linear, and linear()'s choice for float heads."""
        launch.record_launch("gemm")
        if isinstance(head, QuantizedWeight):
            logits = (table.quant_linear if table else ops.quant_linear)(hidden, head).float()
        elif hidden.dtype == torch.float32:
            logits = table.dense_linear(hidden, head) if table else _float_linear(hidden, head)
        else:
            logits = mm_fp32_out(hidden, head)
            if logits is None:
                if self._head_fp32 is None:
                    self._head_fp32 = head.float()
                logits = _float_linear(hidden.float(), self._head_fp32)
        cap = self.soft_cap
        if cap is not None:  # transformers' order: divide, tanh, multiply
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
