"""The CPU GEMV's int4_zp tiles (csrc/cpu/quant_gemv.h): int4 weights whose every group has an
fp16 d and m == -(z d) with an integer z (GPTQ / AWQ's zero points, whose m fp16 cannot hold)
are packed with z as a byte, and must give the int5_g32 tiles' bits (the same fp32 d and m,
stored) for the same weight on every ISA path, both activation widths, odd N (the last tile's
rows past N never written), K of one or several groups of 32 or 128; anything else keeps the
other int4 formats."""

from __future__ import annotations

import pytest
import torch
from kernel_check import assert_quant_gemv_picks, cpu_gemv_into_poisoned

from pagedkern.ops.cpu import quant_gemv
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

SHAPES = [(1, 40, 128), (3, 1000, 256), (5, 17, 384), (17, 40, 128), (40, 33, 256)]  # M, N, K
# (40 rows: the AMX tiles take 32 and more)
PAD = 16  # columns past N in each output row of the raw calls: must stay NaN


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _zero_point_weight(n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    """Random nibbles, fp16 d (both signs, a zero among them) and z in 0..255 (both ends), the
    mins -(z d) in fp32 as the GPTQ / AWQ loader makes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.randn(n, k // group, generator=g) * 0.02).half()
    d[0, 0] = 0.0
    z = torch.randint(0, 256, (n, k // group), generator=g).float()
    z[0, 0], z[-1, -1], z[0, -1] = 0, 255, 16  # (a zero d with a zero z: m is -0)
    mins = -(z * d.float())
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return QuantizedWeight("int4", (n, k), qweight, d, mins, group)


def _raw_gemv(x: torch.Tensor, weight: QuantizedWeight, fmt: str, path: str, bits: int):
    """The module's pack and gemv for tiles of `fmt`, into rows of N + PAD poisoned columns."""
    module, (n, k), group = quant_gemv.cpu_module(), weight.shape, weight.group_size
    code = module.FORMATS[fmt]
    tiles = torch.empty(module.packed_bytes(format=code, n=n, k=k), dtype=torch.uint8)
    if fmt == "int4_zp":
        zeros = (-weight.mins / weight.scales.float()).round().to(torch.uint8).contiguous()
        zeros[0, 0] = 0  # (0 / 0 there)
        module.pack_int4_zp(
            out=tiles.data_ptr(), qweight=weight.qweight.data_ptr(),
            scales=weight.scales.data_ptr(), zeros=zeros.data_ptr(), n=n, k=k, group=group,
        )  # fmt: skip
    else:  # int5_g32: the codes a byte, fp32 d and m per 32
        codes = weight.unpacked_int4().contiguous()
        scales = weight.scales.float().repeat_interleave(group // 32, dim=1).contiguous()
        mins = weight.mins.repeat_interleave(group // 32, dim=1).contiguous()
        module.pack_int5(
            out=tiles.data_ptr(), qweight=codes.data_ptr(), scales=scales.data_ptr(),
            mins=mins.data_ptr(), n=n, k=k,
        )  # fmt: skip
    return tiles, cpu_gemv_into_poisoned(module, code, tiles, x, n, path, bits, PAD)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int4_zp_tiles_give_the_int5_tiles_bits(m, n, k, group, path, bits):
    k = -(-k // group) * group  # whole groups
    weight = _zero_point_weight(n, k, group, seed=m * 7 + n + k + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n * k)) * 2.0
    zp_tiles, zp = _raw_gemv(x, weight, "int4_zp", path, bits)
    int5_tiles, want = _raw_gemv(x, weight, "int5_g32", path, bits)
    assert zp_tiles.numel() * 448 == int5_tiles.numel() * 304  # bytes a block of 32
    assert not want.isnan().any() and torch.equal(zp, want)
    assert_quant_gemv_picks(weight, "int4_zp", zp_tiles, x, want, path, bits)


def _with(weight: QuantizedWeight, scales=None, mins=None) -> QuantizedWeight:
    scales = weight.scales if scales is None else scales
    mins = weight.mins if mins is None else mins
    return QuantizedWeight("int4", weight.shape, weight.qweight, scales, mins, weight.group_size)


def test_the_tile_format_is_chosen_at_pack_time():
    weight = _zero_point_weight(40, 128, 32, seed=1)
    assert quant_gemv.tile_format(weight) == "int4_zp"
    off = weight.mins.clone()
    off.view(torch.int32)[3, 2] += 1  # one group's m one ulp away from -(z d)
    assert quant_gemv.tile_format(_with(weight, mins=off)) == "int5_g32"
    signed_zero = weight.mins.clone()
    signed_zero[0, 0] = 0.0  # d = +0, z = 0: -(z d) is -0, a +0 m is another bit pattern
    assert quant_gemv.tile_format(_with(weight, mins=signed_zero)) == "int5_g32"
    past_a_byte = weight.mins.clone()
    past_a_byte[1, 1] = -256 * weight.scales[1, 1].float()
    assert quant_gemv.tile_format(_with(weight, mins=past_a_byte)) == "int5_g32"
    wide = weight.scales.float().clone()
    wide[2, 2] += 1e-7  # a scale fp16 cannot hold
    assert quant_gemv.tile_format(_with(weight, scales=wide, mins=-(wide * 3))) == "int5_g32"
    symmetric = _with(weight, mins=(-8 * weight.scales.float()).half())
    assert quant_gemv.tile_format(symmetric) == "int4_sym"  # (fewer bytes still)
