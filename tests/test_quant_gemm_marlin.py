"""csrc/quant_gemm_marlin.cu (W4A16 on mma.sync over tile-ordered weights) in the CPU emulator
against the float64 product with the weights the kernel computes (dequantize_marlin: each weight
rounded once to x's dtype) and against the exact reference; the repack round trip; refusals;
statically (both architectures: HMMA, LOP3 dequantization, cp.async, no division routine, no
spills). On a GPU: tests/test_quant_gemm_marlin_gpu.py. The shared check:
tests/quant_gemm_marlin_check.py."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from quant_gemm_marlin_check import check, int4_weight

import pagedkern.ops.quant_gemm  # noqa: F401  (imported before emulated() patches the op modules)
from pagedkern.ops.quant_gemm import marlin_k_splits
from pagedkern.reference.quant_gemm_marlin_layout import (
    dequantize_marlin,
    repack_int4,
    unpack_int4,
)

needs_emulator = pytest.mark.skipif(
    unavailable_reason() is not None, reason=str(unavailable_reason())
)

# (group, M, N, K): M = 1, 3, 17, 40, 64 (1 to 4 m16 tiles, partial ones), N and K multiples
# of 64, both group sizes at 4 m16 tiles, a single K tile (one slice).
CASES = [
    (32, 1, 64, 128),
    (128, 3, 128, 256),
    (32, 17, 64, 192),
    (32, 40, 128, 128),
    (128, 64, 64, 128),
    (32, 64, 64, 64),
]


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_repack_round_trip_and_placement(group, dtype):
    g = torch.Generator().manual_seed(group)
    qw = int4_weight(group, 128, 256, g)
    packed = repack_int4(qw, dtype)
    q = qw.unpacked_int4()
    assert torch.equal(unpack_int4(packed), q)
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.numel() == 128 * 256 // 2
    assert packed.scales.shape == (256 // group, 128) and packed.scales.dtype == dtype
    # one element by the layout's definition: lane l's word ks, bit 16 e + 4 (2 nt + h)
    tiles = packed.qweight.view(128 // 16, 256 // 64, 32, 16)
    for nb, kt, lane, ks, nt, h, e in [
        (0, 0, 0, 0, 0, 0, 0),
        (7, 3, 31, 3, 1, 1, 1),
        (3, 1, 9, 2, 1, 0, 1),
    ]:
        word = int.from_bytes(bytes(tiles[nb, kt, lane, 4 * ks : 4 * ks + 4].tolist()), "little")
        n, k = 16 * nb + 8 * nt + lane // 4, 64 * kt + 16 * ks + 8 * h + 2 * (lane % 4) + e
        assert (word >> (16 * e + 4 * (2 * nt + h))) & 15 == q[n, k]
    # the kernel's weights: within one rounding of the exact ones
    exact = _exact(qw)
    w = dequantize_marlin(packed).double()
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    scale = qw.scales.double().abs().repeat_interleave(group, 1) * 16
    assert ((w - exact).abs() <= scale * ulp + 1e-7).all()


def _exact(qw) -> torch.Tensor:
    from pagedkern.reference.quant_gemm import dequantize

    return dequantize(qw)


@pytest.mark.parametrize(
    "n,k,group,match",
    [(40, 128, 32, "N % 64"), (64, 96, 32, "K % 64"), (64, 128, 64, "group sizes 32 and 128")],
)
def test_repack_refuses_unsupported_shapes(n, k, group, match):
    from pagedkern.reference.quantized_weight import QuantizedWeight

    qw = QuantizedWeight(
        "int4",
        (n, k),
        torch.zeros(n, k // 2, dtype=torch.uint8),
        torch.ones(n, k // group).half(),
        torch.zeros(n, k // group).half(),
        group,
    )
    with pytest.raises(ValueError, match=match):
        repack_int4(qw, torch.bfloat16)


def test_k_splits_fill_the_sms_without_empty_slices():
    assert marlin_k_splits(1, 4096, 4096, 132) == 8  # 64 N tiles x 8 slices of 8 K tiles
    assert marlin_k_splits(1, 14336, 4096, 132) == 3
    assert marlin_k_splits(64, 4096, 4096, 132) == 2  # partial sums <= half the weight bytes
    assert marlin_k_splits(4, 65536, 4096, 132) == 1  # 1024 N tiles fill the SMs alone
    for m, n, k in [(1, 64, 128), (3, 64, 64 * 7), (17, 128, 64 * 10)]:
        s = marlin_k_splits(m, n, k, 132)
        per = -(-(k // 64) // s)
        assert 1 <= s <= k // 64 and (s - 1) * per < k // 64


@needs_emulator
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_marlin_emulated(case, dtype, kernels):
    kernels(quant_gemm="marlin")
    with emulated():
        check(*case, dtype, "cpu")


@needs_emulator
@pytest.mark.parametrize("splits", [1, 2])  # 1: no workspace; 2: uneven slices of 3 and 2 tiles
def test_marlin_emulated_slice_counts(splits, kernels, monkeypatch):
    kernels(quant_gemm="marlin")
    chosen = []

    def fixed(m, n, k, sms):
        chosen.append(splits)
        return splits

    monkeypatch.setattr(pagedkern.ops.quant_gemm, "marlin_k_splits", fixed)
    with emulated():
        check(32, 5, 64, 64 * 5, torch.bfloat16, "cpu")
    assert chosen == [splits]
    # the last slice of each N tile set its counter back to zero for the next launch
    assert all(not c.any() for c in pagedkern.ops.quant_gemm._marlin_counter_cache.values())


@needs_emulator
def test_marlin_kernel_refuses_unsupported_arguments_with_clear_errors():
    module = pytest.importorskip("emulator").load()
    base = dict(
        out=16,
        x=16,
        qweight=16,
        scales=16,
        mins=16,
        workspace=0,
        counters=0,
        m=1,
        n=64,
        k=128,
        x_stride=128,
        out_stride=64,
        group_size=32,
        k_splits=1,
        dtype=0,
        device=0,
        stream=0,
    )
    for change, match in [
        ({"n": 40}, r"n \(40\) must be a positive multiple of 64"),
        ({"k": 96, "x_stride": 96}, r"k \(96\) must be a positive multiple of 64"),
        ({"group_size": 64}, r"group_size \(64\) must be 32 or 128"),
        ({"m": 65}, "m must be in 0..64"),
        ({"k_splits": 2}, "needs a workspace"),
        ({"k_splits": 2, "workspace": 16}, "zeroed counters"),
    ]:
        with pytest.raises(ValueError, match=match):
            module.quant_gemm_marlin(**{**base, **change})


@needs_emulator
def test_marlin_variant_runs_v1_for_weights_it_cannot_take(kernels):
    # int8, and N not a multiple of 64: the v1 kernel, still checked against the reference
    from quant_gemm_check import check as check_v1

    kernels(quant_gemm="marlin")
    with emulated():
        check_v1("int8", 0, 3, 11, 96, torch.bfloat16, "cpu")
        check_v1("int4", 32, 2, 40, 128, torch.float16, "cpu")


@pytest.mark.static
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_marlin_machine_code(cuda_binary, arch):
    sass = {n: s for n, s in cuda_binary.sass(arch).items() if "quant_gemm_marlin_kernel" in n}
    # 2 dtypes x 4 m16 tile counts x 2 group sizes
    assert len(sass) == 16, f"expected 16 quant_gemm_marlin_kernel variants on {arch}: {list(sass)}"
    resources = {n: r for n, r in cuda_binary.resources(arch).items() if "quant_gemm_marlin" in n}
    spilling = {n: r for n, r in resources.items() if r.local or r.stack}
    assert not spilling, f"quant_gemm_marlin spills on {arch}: {spilling}"
    for name, text in sass.items():
        for opcode in (
            "HMMA.16816.F32",
            "LDSM.16.M88.4",
            "LDGSTS.E.BYPASS.128",
            "LOP3.LUT",
            "HFMA2",
        ):
            assert opcode in text, f"{name}: no {opcode}"
        # a subroutine (the 64-bit division of v1) ends in RET; sm_80 spells loop exits
        # CALL.REL.NOINC without one
        assert " RET" not in text, f"{name}: calls a subroutine (a division?)"
        assert "I2F" not in text, f"{name}: integer-to-float conversions in the dequantization"


@needs_emulator
def test_marlin_variant_runs_v1_into_an_out_not_8_byte_aligned(kernels):
    from kernel_check import assert_close_to

    from pagedkern.reference.quant_gemm import quant_linear

    kernels(quant_gemm="marlin")
    qw = int4_weight(32, 64, 128, torch.Generator().manual_seed(4))
    x = torch.randn(2, 128).half()
    out = torch.full((2 * 64 + 1,), float("nan")).half()[1:].view(2, 64)  # 2-byte offset
    with emulated():
        pagedkern.ops.quant_linear(x, qw, out=out)
    assert not qw.packed, "the marlin kernel ran on a misaligned out"
    assert_close_to(out, quant_linear(x.double(), qw), torch.float16)


@pytest.mark.static
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_marlin_k_loop_is_tensor_core_work(cuda_binary, arch):
    # Per 64-wide K tile each warp: 4 k16 steps x 2 n8 fragments x kMT m16 tiles of HMMA, one
    # ldmatrix.x4 per step and m16 tile, and the dequantization of 16 B registers (one
    # subtraction of the magic number and one HFMA2 each; bf16 on sm_80 subtracts by HFMA2).
    import re
    from collections import Counter

    from test_static_kernels import _loops

    for name, sass in cuda_binary.sass(arch).items():
        if "quant_gemm_marlin_kernel" not in name:
            continue
        m_tiles = int(re.search(r"Li(\d)ELi\dEEEv", name).group(1))
        loop = max((b for b in _loops(sass) if any("HMMA" in t for t in b)), key=len)
        ops = ("HMMA", "LDSM", "HFMA2", "HADD2", "I2F")
        count = Counter(op for t in loop for op in ops if op in t)
        assert count["HMMA"] == 8 * m_tiles, f"{name}: {count}"
        assert count["LDSM"] == 4 * m_tiles, f"{name}: {count}"
        # (the compiler may keep one more packed add or move in the loop)
        assert 32 <= count["HFMA2"] + count["HADD2"] <= 34 and not count["I2F"], f"{name}: {count}"
