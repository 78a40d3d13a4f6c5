"""The quant_gemm_marlin check shared by the emulated tests (tests/test_quant_gemm_marlin.py)
and the GPU tests (tests/test_quant_gemm_marlin_gpu.py): fresh random int4 weights, the output
NaN-poisoned beforehand, compared with the float64 product with the kernel's weights (each
rounded once to x's dtype: dequantize_marlin) and, looser, with the exact reference."""

from __future__ import annotations

import torch
from kernel_check import assert_close_to, poisoned

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_int4
from pagedkern.ops.quant_gemm import marlin_packed
from pagedkern.reference.quant_gemm import quant_linear
from pagedkern.reference.quant_gemm_marlin_layout import dequantize_marlin


def int4_weight(group: int, n: int, k: int, g: torch.Generator, device="cpu"):
    w = torch.randn(n, k, generator=g) * 0.05 + 0.02 * torch.randn(n, 1, generator=g)
    return quantize_int4(w, group).to(device)


def check(group, m, n, k, dtype, device):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k + group)
    qw = int4_weight(group, n, k, g, device)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    out = poisoned((m, n), dtype, device)
    result = ops.quant_linear(x, qw, out=out)
    assert result is out
    assert any(key.startswith("marlin") for key in qw.packed), "the marlin kernel did not run"
    got = out.cpu().double()
    assert not torch.isnan(got).any(), "output holds NaN (poison survived or kernel produced it)"
    w = dequantize_marlin(marlin_packed(qw, dtype)).cpu().double()
    ref = x.cpu().double() @ w.T
    # fp32 accumulation of the kernel's weights: the error is the output's rounding
    bound = ref.abs() * (2**-8 if dtype == torch.bfloat16 else 2**-11) + 1e-4
    assert ((got - ref).abs() <= bound).all(), float((got - ref).abs().max())
    assert_close_to(out.cpu(), quant_linear(x.cpu().double(), qw.to("cpu")), dtype)
