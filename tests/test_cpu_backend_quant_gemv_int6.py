"""The CPU GEMM's int6_g16 tiles (csrc/cpu/pack.cpp pack_int6): int8 with a scale per 16 whose
codes all lie in -32..31 (a GGUF Q6_K tensor, as model/quantized_linear.gguf_to_int8 gives it)
held in 6 bits, 8 bits a weight with the scales, against 10 for the int8_g16 tiles of the same
weight. Unpacked to the same codes, they must give the int8_g16 tiles' bits on every path, M
and activation width; quant_gemv picks them by itself, and refuses nothing it should take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_check import cpu_gemv_into_poisoned, poisoned

from pagedkern.ops.cpu import quant_gemv
from pagedkern.reference.quant_gemm import quant_linear as ref_quant_linear
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

SHAPES = [(1, 37, 64), (3, 960, 256), (5, 16, 128), (17, 50, 384), (64, 33, 32)]
PAD = 3  # poisoned columns past N: no kernel may write them


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _six_bit_weight(n: int, k: int, seed: int) -> QuantizedWeight:
    """Q6_K's shape: codes -32..31 (both ends present), fp32 scales per 16 (d * sc: an fp16 d
    times an int8), one row's scales all zero."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    q[0, 0], q[-1, -1] = -32, 31
    d = torch.rand(n, 1, generator=g).half().float() * 1e-3
    sc = torch.randint(-128, 128, (n, k // 16), generator=g).float()
    scales = d * sc
    scales[n // 2] = 0
    return QuantizedWeight("int8", (n, k), q, scales, None, 16)


def _raw_gemv(x: torch.Tensor, weight: QuantizedWeight, fmt: str, path: str, bits: int):
    """The module's pack and gemv for tiles of `fmt`, into rows of N + PAD poisoned columns."""
    module, (n, k) = quant_gemv.cpu_module(), weight.shape
    code = module.FORMATS[fmt]
    tiles = torch.empty(module.packed_bytes(format=code, n=n, k=k), dtype=torch.uint8)
    args = dict(out=tiles.data_ptr(), qweight=weight.qweight.data_ptr(),
                scales=weight.scales.data_ptr(), n=n, k=k)  # fmt: skip
    if fmt == "int6_g16":
        module.pack_int6(**args)
    else:
        module.pack_int8_grouped(**args, group=16)
    return tiles, cpu_gemv_into_poisoned(module, code, tiles, x, n, path, bits, PAD)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int6_tiles_give_the_int8_g16_tiles_bits(m, n, k, path, bits):
    weight = _six_bit_weight(n, k, seed=m * 7 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n * k)) * 2.0
    six_tiles, six = _raw_gemv(x, weight, "int6_g16", path, bits)
    int8_tiles, want = _raw_gemv(x, weight, "int8_g16", path, bits)
    assert six_tiles.numel() * 5 == int8_tiles.numel() * 4  # 512 bytes a block, not 640
    assert not want.isnan().any() and torch.equal(six, want)
    out = poisoned((m, n), torch.float32, "cpu")
    got = quant_gemv.quant_gemv(x, weight, path=path, out=out, activation_bits=bits)
    assert quant_gemv.tile_format(weight) == "int6_g16"
    assert torch.equal(quant_gemv.packed(weight), six_tiles) and torch.equal(got, want)
    exact = ref_quant_linear(x.double(), weight)  # a loose check that neither is wrong
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_a_code_outside_six_bits_keeps_the_int8_tiles():
    weight = _six_bit_weight(20, 64, seed=1)
    weight.qweight[3, 7] = 32  # one code past 31
    assert quant_gemv.tile_format(weight) == "int8_g16"
    x = torch.randn(2, 64)
    exact = ref_quant_linear(x.double(), weight)
    got = quant_gemv.quant_gemv(x, weight).double()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-3


def test_pack_int6_refuses_codes_outside_six_bits():
    module = quant_gemv.cpu_module()
    q = np.zeros((16, 32), dtype=np.int8)
    q[2, 5] = -33
    qt, scales = torch.from_numpy(q), torch.ones(16, 2)
    tiles = torch.empty(module.packed_bytes(format=module.FORMATS["int6_g16"], n=16, k=32),
                        dtype=torch.uint8)  # fmt: skip
    with pytest.raises(ValueError, match="-32..31"):
        module.pack_int6(out=tiles.data_ptr(), qweight=qt.data_ptr(), scales=scales.data_ptr(),
                         n=16, k=32)  # fmt: skip
