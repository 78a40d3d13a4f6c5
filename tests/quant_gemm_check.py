"""The quant_gemm kernel checks shared by the emulated and static tests
(tests/test_quant_gemm_kernel.py) and the GPU tests (tests/test_quant_gemm_gpu.py): fresh random
weights over odd shapes, the output NaN-poisoned beforehand, compared with the float64
dequantize-then-matmul reference."""

from __future__ import annotations

import torch
from kernel_check import assert_close_to, poisoned

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_int4, quantize_int8
from pagedkern.reference.quant_gemm import quant_linear

# (format, group, M, N, K): M across the 8-row tile (1, 5, 8, 9, 64), N not a multiple of the
# 8 warps of a block, K with a partial last warp pass and both group sizes.
CASES = [
    ("int4", 32, 1, 13, 96),
    ("int4", 32, 9, 40, 1056),
    ("int4", 128, 5, 24, 384),
    ("int4", 128, 64, 8, 256),
    ("int8", 0, 1, 11, 96),
    ("int8", 0, 8, 33, 1056),
    ("int8", 0, 17, 16, 64),
]


def weight(fmt: str, group: int, n: int, k: int, g: torch.Generator, device="cpu"):
    w = torch.randn(n, k, generator=g) * 0.05 + 0.02 * torch.randn(n, 1, generator=g)
    qw = quantize_int8(w) if fmt == "int8" else quantize_int4(w, group)
    return qw.to(device)


def check(fmt, group, m, n, k, dtype, device):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    qw = weight(fmt, group, n, k, g, device)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    out = poisoned((m, n), dtype, device)
    result = ops.quant_linear(x, qw, out=out)
    assert result is out
    ref = quant_linear(x.cpu().double(), qw.to("cpu"))  # exact dequantization, float64
    assert_close_to(out.cpu(), ref, dtype)
    # fp32 accumulation: the error is the final rounding, not the K-term sum
    bound = ref.abs() * (2**-8 if dtype == torch.bfloat16 else 2**-11) + 1e-4
    assert ((out.cpu().double() - ref).abs() <= bound).all()
