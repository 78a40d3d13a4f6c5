"""csrc/quant_gemm_marlin.cu (the quant_gemm:marlin variant) on a GPU: the emulator's cases
plus the decode shapes of an 8B model at M = 1, 4, 16, 64, against the float64 product with the
kernel's weights and the exact reference (tests/quant_gemm_marlin_check.py). The emulated,
repack and static tests: tests/test_quant_gemm_marlin.py."""

from __future__ import annotations

import pytest
import torch
from quant_gemm_marlin_check import check, int4_weight

from pagedkern import ops

pytestmark = pytest.mark.gpu

CASES = [(32, 1, 64, 128), (128, 3, 128, 256), (32, 17, 64, 192), (128, 64, 64, 128)]
MODEL_SHAPES = [
    (128, 1, 4096, 4096),
    (32, 4, 14336, 4096),
    (128, 16, 4096, 14336),
    (32, 64, 6144, 4096),
]


@pytest.fixture(autouse=True)
def marlin(kernels):
    kernels(quant_gemm="marlin")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + MODEL_SHAPES)
def test_quant_gemm_marlin_gpu(case, dtype):
    check(*case, dtype, "cuda")


def test_quant_gemm_marlin_gpu_side_stream_and_strided_x():
    g = torch.Generator().manual_seed(3)
    qw = int4_weight(128, 256, 512, g, "cuda")
    base = torch.randn(5, 520, generator=g).bfloat16().cuda()
    x = base[:, :512]  # row stride 520: x_stride != K
    ref = ops.quant_linear(x.contiguous(), qw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ops.quant_linear(x, qw)
    stream.synchronize()
    assert torch.equal(out, ref)  # the slices are added in a fixed order: bit-identical
