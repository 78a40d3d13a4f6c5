"""The CPU GEMM's 6-bit tiles (csrc/cpu/pack.cpp): int8 with a scale per 16 whose codes all lie
in -32..31 (a GGUF Q6_K tensor, as model/quantized_linear.gguf_to_int8 gives it) held in 6 bits.
int6_k (pack_int6_k) keeps Q6_K's own scales, an int8 per 16 times an fp32 per 256, factored
back out of the fp32 scales exactly: 6.625 bits a weight. int6_g16 (pack_int6), for scales that
do not factor or K not a multiple of 256, keeps them in fp32: 8 bits a weight. Against 10 for
the int8_g16 tiles of the same weight. Unpacked to the same codes and scales, both must give the
int8_g16 tiles' bits on every path, M and activation width; quant_gemv picks them by itself, and
refuses nothing it should take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_check import assert_quant_gemv_picks, cpu_gemv_into_poisoned, poisoned, six_bit_weight

from pagedkern.ops.cpu import quant_gemv
from pagedkern.reference.quant_gemm import quant_linear as ref_quant_linear
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

# 1 and 2 rows of 19 and 11 tiles: the x86 kernels' tiles read at once, and the rest
SHAPES = [(1, 37, 64), (1, 301, 64), (2, 165, 128), (3, 960, 256), (5, 16, 128), (17, 50, 384),
          (64, 33, 32)]  # fmt: skip
K_SHAPES = [(1, 37, 256), (1, 301, 256), (2, 165, 512), (3, 960, 512), (5, 16, 256),
            (9, 50, 768), (64, 33, 256)]  # fmt: skip
PAD = 3  # poisoned columns past N: no kernel may write them


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _factored(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """factor_int6_scales's d [N, K / 256] and c [N, K / 16] (asserting it factors)."""
    module, (n, k) = quant_gemv.cpu_module(), weight.shape
    d, c = torch.empty(n, k // 256), torch.empty(n, k // 16, dtype=torch.int8)
    assert module.factor_int6_scales(
        scales=weight.scales.data_ptr(), n=n, k=k, d=d.data_ptr(), c=c.data_ptr()
    )
    return d, c


def _raw_gemv(x: torch.Tensor, weight: QuantizedWeight, fmt: str, path: str, bits: int):
    """The module's pack and gemv for tiles of `fmt`, into rows of N + PAD poisoned columns."""
    module, (n, k) = quant_gemv.cpu_module(), weight.shape
    code = module.FORMATS[fmt]
    tiles = torch.empty(module.packed_bytes(format=code, n=n, k=k), dtype=torch.uint8)
    args = dict(out=tiles.data_ptr(), qweight=weight.qweight.data_ptr(),
                scales=weight.scales.data_ptr(), n=n, k=k)  # fmt: skip
    if fmt == "int6_g16":
        module.pack_int6(**args)
    elif fmt == "int6_k":
        d, c = _factored(weight)
        del args["scales"]
        module.pack_int6_k(**args, c=c.data_ptr(), d=d.data_ptr())
    else:
        module.pack_int8_grouped(**args, group=16)
    return tiles, cpu_gemv_into_poisoned(module, code, tiles, x, n, path, bits, PAD)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int6_tiles_give_the_int8_g16_tiles_bits(m, n, k, path, bits):
    weight = six_bit_weight(n, k, seed=m * 7 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n * k)) * 2.0
    six_tiles, six = _raw_gemv(x, weight, "int6_g16", path, bits)
    int8_tiles, want = _raw_gemv(x, weight, "int8_g16", path, bits)
    assert six_tiles.numel() * 5 == int8_tiles.numel() * 4  # 512 bytes a block, not 640
    assert not want.isnan().any() and torch.equal(six, want)
    out = poisoned((m, n), torch.float32, "cpu")
    got = quant_gemv.quant_gemv(x, weight, path=path, out=out, activation_bits=bits)
    if k % 256:  # else its scales factor: int6_k (below)
        assert quant_gemv.tile_format(weight) == "int6_g16"
        assert torch.equal(quant_gemv.packed(weight), six_tiles)
    assert torch.equal(got, want)
    exact = ref_quant_linear(x.double(), weight)  # a loose check that neither is wrong
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_a_code_outside_six_bits_keeps_the_int8_tiles():
    weight = six_bit_weight(20, 64, seed=1)
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


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("m,n,k", K_SHAPES)
def test_int6_k_tiles_give_the_int8_g16_tiles_bits(m, n, k, path, bits):
    weight = six_bit_weight(n, k, seed=m * 5 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n + k)) * 2.0
    k_tiles, got_k = _raw_gemv(x, weight, "int6_k", path, bits)
    int8_tiles, want = _raw_gemv(x, weight, "int8_g16", path, bits)
    tiles = (n + 15) // 16
    assert k_tiles.numel() == tiles * (k // 256) * 3392  # 6.625 bits a weight
    assert not want.isnan().any() and torch.equal(got_k, want)
    assert_quant_gemv_picks(weight, "int6_k", k_tiles, x, want, path, bits)


def _scales_of(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (c.float().view(*d.shape, 16) * d[..., None]).view(c.shape)


def test_factoring_recovers_exact_scales_of_every_kind():
    """Q6_K scales of llama.cpp's form (the largest c -128) and others (the largest 127 or 77;
    d of either sign, fp16 or of 16 significant bits, tiny and huge: any d whose products with
    an int8 are exact in fp32), all-zero and signed-zero blocks: each factors, and c * d gives
    each scale back bit for bit."""
    g = torch.Generator().manual_seed(3)
    n, k = 12, 512
    c = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    d = torch.randn(n, k // 256, generator=g).half().float()
    c.view(n, -1, 16)[0, :, 5] = -128
    c.view(n, -1, 16)[1, :, :] = c.view(n, -1, 16)[1].clamp(-127, 127)
    c.view(n, -1, 16)[1, :, 3] = 127
    c.view(n, -1, 16)[2, :, :] = torch.randint(-77, 78, (k // 256, 16), generator=g)
    c.view(n, -1, 16)[2, :, 9] = -77
    d[3] = (torch.randn(k // 256, generator=g) * 2**15).round() * 2.0**-120  # not fp16, tiny
    d[4] = d[4] * 2.0**100
    c.view(n, -1, 16)[5, 0] = 0  # an all-zero super-block
    scales = _scales_of(d, c)
    scales[6, :16] = -0.0
    weight = QuantizedWeight("int8", (n, k), torch.zeros(n, k, dtype=torch.int8), scales, None, 16)
    got_d, got_c = _factored(weight)
    back = _scales_of(got_d, got_c)
    assert torch.equal(back, scales)  # == treats -0 as 0; the bits of every non-zero scale:
    nonzero = scales != 0
    assert torch.equal(back[nonzero].view(torch.int32), scales[nonzero].view(torch.int32))
    assert quant_gemv.tile_format(weight) == "int6_k"


@pytest.mark.parametrize("case", ["random_fp32", "nan", "inf", "k_not_256"])
def test_scales_that_do_not_factor_keep_the_int6_g16_tiles(case):
    n, k = 20, 512 if case != "k_not_256" else 288
    weight = six_bit_weight(n, k, seed=4)
    if case == "random_fp32":
        weight.scales[7, 16:32] = torch.rand(16) + 0.5  # no int8 c times one d gives these
    elif case == "nan":
        weight.scales[7, 3] = float("nan")
    elif case == "inf":
        weight.scales[0, 30] = float("inf")
    assert quant_gemv.tile_format(weight) == "int6_g16"
    if case in ("random_fp32", "k_not_256"):
        x = torch.randn(3, k)
        _, want = _raw_gemv(x, weight, "int8_g16", quant_gemv.best_path(), 16)
        assert torch.equal(quant_gemv.quant_gemv(x, weight), want)
