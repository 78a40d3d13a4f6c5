"""csrc/quant_gemm.cu (W4A16 / W8A16, M <= 64) against the float64 dequantize-then-matmul
reference in the CPU emulator (the real .cu compiled by g++), and statically (both
architectures, no spills, 16-byte weight loads); on a GPU: tests/test_quant_gemm_gpu.py. The
cases and the check: tests/quant_gemm_check.py."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from quant_gemm_check import CASES, check, weight

import pagedkern.ops.quant_gemm  # noqa: F401  (imported before emulated() patches the op modules)
from pagedkern import ops
from pagedkern.reference.quantized_weight import QuantizedWeight


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


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_quant_gemm_emulated_reads_fp32_int4_scales_as_fp16():
    """int4 with fp32 scales and mins (GGUF Q4_K's): the kernel reads fp16 copies, made once,
    so it computes what it computes for the weight with fp16 ones."""
    half = weight("int4", 32, 24, 256, torch.Generator().manual_seed(1))
    nudge = 1 + 2.0**-14  # fp32 values fp16 cannot hold, rounding back to half's
    exact = QuantizedWeight("int4", half.shape, half.qweight, half.scales.float() * nudge,
                            half.mins.float() * nudge, 32)  # fmt: skip
    assert not torch.equal(exact.scales.half().float(), exact.scales)
    assert torch.equal(exact.scales.half(), half.scales)
    x = torch.randn(3, 256).half()
    with emulated():
        want = ops.quant_linear(x, half)
        got = ops.quant_linear(x, exact)
        again = ops.quant_linear(x, exact)
    assert not want.isnan().any() and torch.equal(got, want) and torch.equal(again, want)


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
