"""csrc/quant_gemm.cu (W4A16 / W8A16) on a GPU against the float64 dequantize-then-matmul
reference: the emulator's cases plus the decode shapes of an 8B model, and a prefill-shaped M
(the dequantized workspace and cuBLAS). The emulated and static tests:
tests/test_quant_gemm_kernel.py."""

from __future__ import annotations

import pytest
import torch
from kernel_check import assert_close_to
from quant_gemm_check import CASES, check, weight

from pagedkern import ops
from pagedkern.reference.quant_gemm import dequantize

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    CASES
    + [("int4", 32, 16, 4096, 4096), ("int4", 128, 4, 14336, 4096), ("int8", 0, 2, 4096, 4096)],
)
def test_quant_gemm_gpu(case, dtype):
    check(*case, dtype, "cuda")


def test_quant_gemm_gpu_prefill_shaped_m_uses_the_dequantized_workspace():
    g = torch.Generator().manual_seed(5)
    qw = weight("int4", 32, 64, 256, g, "cuda")
    x = torch.randn(200, 256, generator=g).half().cuda()
    ref = x.cpu().double() @ dequantize(qw.to("cpu")).T
    assert_close_to(ops.quant_linear(x, qw).cpu(), ref, torch.float16)
