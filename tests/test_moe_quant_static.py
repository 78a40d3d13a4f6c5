"""Machine code of the quantized-experts MoE kernel (csrc/moe_gemm_quant.cu), read from the built
extension: every variant on tensor cores, its tiles staged by 16-byte cp.async, no spills, no
subroutine (an integer division) but SiLU's, and the K loop free of integer-to-float
conversions (the int4 codes through the LOP3 + HSUB2 + HFMA2 magic-number path, the int8 ones
through PRMT / fp32 magic)."""

from __future__ import annotations

import re

import pytest
from test_static_kernels import _loops

pytestmark = pytest.mark.static
ARCHS = ("sm_80", "sm_90a")
KERNEL = "moe_gemm_quant_kernel"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_is_tensor_core_work_staged_by_cp_async(cuda_binary, arch):
    sass = {n: s for n, s in cuda_binary.sass(arch).items() if KERNEL in n}
    # 2 dtypes x 2 row tiles x 2 weight formats x (gate_up silu, gate_up gelu_tanh, down)
    assert len(sass) == 24, sorted(sass)
    resources = {n: r for n, r in cuda_binary.resources(arch).items() if "moe_gemm_quant" in n}
    spilling = {n: r for n, r in resources.items() if r.local or r.stack}
    assert not spilling, f"{KERNEL} spills on {arch}: {spilling}"
    for name, text in sass.items():
        for opcode in ("HMMA.16816.F32", "LDGSTS.E.BYPASS.128"):
            assert opcode in text, f"{name}: no {opcode}"
        # a subroutine ends in RET: none, but SiLU's fp32 division (its slow path, epilogue)
        if "4Silu" not in name:
            assert not re.search(r"\bRET\b", text), f"{name}: calls a subroutine (a division?)"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_k_loop_dequantizes_without_integer_to_float_conversions(cuda_binary, arch):
    for name, sass in cuda_binary.sass(arch).items():
        if KERNEL not in name:
            continue
        loop = max((b for b in _loops(sass) if any("HMMA" in t for t in b)), key=len)
        assert not any("I2F" in t for t in loop), f"{name}: I2F in the K loop"
        int4 = "ELi4E" in name  # moe_gemm_quant_kernel<T, kBM, kGated, kBits = 4, Act>
        if int4:
            assert any("LOP3" in t for t in loop) and any("HFMA2" in t for t in loop), name
        assert any("LDGSTS" in t for t in loop), f"{name}: the K loop stages no tile"
