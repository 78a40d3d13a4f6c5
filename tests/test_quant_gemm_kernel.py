"""csrc/quant_gemm.cu (W4A16 / W8A16, M <= 64) against the float64 dequantize-then-matmul
reference: in the CPU emulator (the real .cu compiled by g++), on a GPU (skipped without one),
and statically (both architectures, no spills, 16-byte weight loads). Inputs are fresh random
values over odd shapes; the output is NaN-poisoned beforehand."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from kernel_check import assert_close_to, poisoned

import pagedkern.ops.quant_gemm  # noqa: F401  (imported before emulated() patches the op modules)
from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_int4, quantize_int8
from pagedkern.reference.quant_gemm import dequantize, quant_linear

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


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_quant_gemm_emulated(case, dtype):
    with emulated():
        check(*case, dtype, "cpu")


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_quant_gemm_emulated_rejects_bad_arguments():
    qw = weight("int4", 32, 8, 64, torch.Generator().manual_seed(0))
    with emulated(expect_launch=False), pytest.raises(ValueError, match="out"):
        ops.quant_linear(torch.randn(2, 64).half(), qw, out=torch.empty(2, 7).half())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    CASES
    + [("int4", 32, 16, 4096, 4096), ("int4", 128, 4, 14336, 4096), ("int8", 0, 2, 4096, 4096)],
)
def test_quant_gemm_gpu(case, dtype):
    check(*case, dtype, "cuda")


@pytest.mark.gpu
def test_quant_gemm_gpu_prefill_shaped_m_uses_the_dequantized_workspace():
    g = torch.Generator().manual_seed(5)
    qw = weight("int4", 32, 64, 256, g, "cuda")
    x = torch.randn(200, 256, generator=g).half().cuda()
    ref = x.cpu().double() @ dequantize(qw.to("cpu")).T
    assert_close_to(ops.quant_linear(x, qw).cpu(), ref, torch.float16)


@pytest.mark.static
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_quant_gemm_machine_code(cuda_binary, arch):
    resources = {n: r for n, r in cuda_binary.resources(arch).items() if "quant_gemm_kernel" in n}
    assert len(resources) == 4, f"expected 4 quant_gemm_kernel variants on {arch}: {resources}"
    spilling = {n: r for n, r in resources.items() if r.local or r.stack}
    assert not spilling, f"quant_gemm spills on {arch}: {spilling}"
    for name, sass in cuda_binary.sass(arch).items():
        if "quant_gemm_kernel" in name:
            assert "LDG.E.128.CONSTANT" in sass or "LDG.E.128" in sass, f"{name}: no 16-byte loads"
