"""The CPU GEMV's int4_sym tiles (csrc/cpu/quant_gemv.h): int4 weights whose every group has
m == -8 d exactly (GGUF Q4_0) are packed without the m, and must give the int4 tiles' bits for
the same weight on every ISA path, both activation widths, odd N (the last tile's rows past N
never written), K of one or several groups of 32 or 128; anything else keeps the int4 tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_check import assert_quant_gemv_picks, cpu_gemv_into_poisoned

from pagedkern.model.quantized_linear import gguf_to_int4, quantize_int4
from pagedkern.ops.cpu import quant_gemv
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

SHAPES = [(1, 40, 128), (3, 1000, 256), (5, 17, 384), (17, 40, 128)]  # M, N, K
PAD = 16  # columns past N in each output row of the raw calls: must stay NaN


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _symmetric_weight(n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    """Random nibbles and fp16 d (both signs, zeros among them), m = -8 d as Q4_0 loads it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.randn(n, k // group, generator=g) * 0.02).half()
    d[0, 0] = 0.0
    mins = (-8 * d.float()).half()
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return QuantizedWeight("int4", (n, k), qweight, d, mins, group)


def _raw_gemv(x: torch.Tensor, weight: QuantizedWeight, fmt: str, path: str, bits: int):
    """The module's pack and gemv for tiles of `fmt`, into rows of N + PAD poisoned columns."""
    module, (n, k) = quant_gemv.cpu_module(), weight.shape
    code = module.FORMATS[fmt]
    tiles = torch.empty(module.packed_bytes(format=code, n=n, k=k), dtype=torch.uint8)
    module.pack_int4(
        out=tiles.data_ptr(), qweight=weight.qweight.data_ptr(), scales=weight.scales.data_ptr(),
        mins=weight.mins.data_ptr(), n=n, k=k, group=weight.group_size, format=code,
    )  # fmt: skip
    return tiles, cpu_gemv_into_poisoned(module, code, tiles, x, n, path, bits, PAD)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int4_sym_tiles_give_the_int4_tiles_bits(m, n, k, group, path, bits):
    k = -(-k // group) * group  # whole groups
    weight = _symmetric_weight(n, k, group, seed=m * 7 + n + k + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n * k)) * 2.0
    sym_tiles, sym = _raw_gemv(x, weight, "int4_sym", path, bits)
    int4_tiles, want = _raw_gemv(x, weight, "int4", path, bits)
    assert sym_tiles.numel() * 10 == int4_tiles.numel() * 9  # 288 bytes a block, not 320
    assert not want.isnan().any() and torch.equal(sym, want)
    assert_quant_gemv_picks(weight, "int4_sym", sym_tiles, x, want, path, bits)


def _with_mins(weight: QuantizedWeight, mins: torch.Tensor) -> QuantizedWeight:
    fmt, shape, group = weight.format, weight.shape, weight.group_size
    return QuantizedWeight(fmt, shape, weight.qweight, weight.scales, mins, group)


def test_the_tile_format_is_chosen_at_pack_time():
    weight = _symmetric_weight(40, 128, 32, seed=1)
    assert quant_gemv.tile_format(weight) == "int4_sym"
    off = weight.mins.clone()
    off.view(torch.int16)[3, 2] += 1  # one group's m one ulp away from -8 d
    assert quant_gemv.tile_format(_with_mins(weight, off)) == "int4"
    signed_zero = weight.mins.clone()
    signed_zero[0, 0] = 0.0  # d = +0: -8 d is -0, a +0 m is another bit pattern
    assert quant_gemv.tile_format(_with_mins(weight, signed_zero)) == "int4"
    assert quant_gemv.tile_format(quantize_int4(torch.randn(40, 128), 32)) == "int4"


def _gguf_blocks(n: int, k: int, fields: int, seed: int) -> np.ndarray:
    """Random GGUF Q4_0 (fields=1: d) or Q4_1 (fields=2: d, m) rows: fp16 fields then 16 bytes."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // 32, 2 * fields + 16), dtype=np.uint8)
    head = (rng.standard_normal((n * k // 32, fields)) * 0.02).astype(np.float16)
    blocks[:, : 2 * fields] = head.view(np.uint8)
    return blocks.reshape(n, -1)


def test_gguf_q4_0_packs_int4_sym_and_q4_1_int4():
    q4_0 = gguf_to_int4("Q4_0", _gguf_blocks(24, 64, 1, seed=2), 24, 64)
    q4_1 = gguf_to_int4("Q4_1", _gguf_blocks(24, 64, 2, seed=3), 24, 64)
    assert quant_gemv.tile_format(q4_0) == "int4_sym"
    assert quant_gemv.tile_format(q4_1) == "int4"
    data = _gguf_blocks(24, 64, 1, seed=4)
    data[5, :2] = np.array([9000.0], dtype=np.float16).view(np.uint8)  # -8 d overflows fp16
    with np.errstate(over="ignore"):  # the loader's fp16 m is -inf there
        overflow = gguf_to_int4("Q4_0", data, 24, 64)
    assert quant_gemv.tile_format(overflow) == "int4"


def test_a_format_the_module_lacks_is_an_error():
    module = quant_gemv.cpu_module()
    missing = len(module.FORMATS)  # the first code past the module's formats
    with pytest.raises(ValueError, match="format"):
        module.packed_bytes(format=missing, n=16, k=32)
    y, x = torch.empty(1, 16), torch.zeros(1, 32)
    with pytest.raises(ValueError, match="format"):
        module.gemv(
            format=missing, y=y.data_ptr(), y_stride=16, x=x.data_ptr(), x_stride=32, packed=0,
            scales=0, m=1, n=16, k=32, threads=1, path=-1, activation_bits=16,
        )  # fmt: skip
