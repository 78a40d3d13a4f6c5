"""The CPU GEMM's int4_k tiles (csrc/cpu/pack.cpp): int4 whose scales and mins per 32 factor as
GGUF Q4_K's, an unsigned 8-bit c times an fp32 d per row and 256 K, kept in that form: 4.75 bits
a weight, against int4's 5 (fp16 scales and mins) and int5_g32's 7 (fp32 ones). A Q4_K's scales
are exact in fp32 only (model/quantized_linear.gguf_to_int4 keeps them so), and they always
factor. The kernels form each scale and min as float(c) * d, the fp32 values int5_g32 stores,
so int4_k gives int5_g32's bits, and int4's where the scales are fp16 values, on every path, M
and activation width. quant_gemv picks the tiles by itself: int4_sym, int4_k, int4, int5_g32."""

from __future__ import annotations

import pytest
import torch
from kernel_check import assert_quant_gemv_picks, cpu_gemv_into_poisoned

from pagedkern.ops.cpu import quant_gemv
from pagedkern.reference.quant_gemm import quant_linear as ref_quant_linear
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

# 1 and 2 rows of 19 and 11 tiles: the x86 kernels' tiles read at once, and the rest
SHAPES = [(1, 37, 256), (1, 301, 256), (2, 165, 512), (3, 960, 512), (5, 16, 256),
          (9, 50, 768), (64, 33, 256)]  # fmt: skip
PAD = 3  # poisoned columns past N: no kernel may write them


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _q4k_weight(n: int, k: int, seed: int, sc_max: int = 63) -> QuantizedWeight:
    """Q4_K's form: codes 0..15 (both ends present), scale d * sc and min -(dmin * mn) per 32
    in fp32 (d, dmin fp16 per 256, sc and mn 6 bits, each super-block's largest sc_max as
    llama.cpp's quantizer gives it), one row all zero."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, 0], codes[-1, -1] = 0, 15

    def two_level(scale: float) -> torch.Tensor:
        d = (torch.rand(n, k // 256, generator=g) * scale + scale / 10).half().float()
        c = torch.randint(0, sc_max + 1, (n, k // 256, 8), generator=g)
        c[..., int(torch.randint(0, 8, (1,), generator=g))] = sc_max
        return (c.float() * d[..., None]).view(n, k // 32)

    scales, mins = two_level(1e-3), -two_level(5e-3)
    scales[n // 2], mins[n // 2] = 0.0, -0.0
    return QuantizedWeight("int4", (n, k), _pack_nibbles(codes), scales, mins, 32)


def _factored(weight: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """factor_int4_scales's d, dm [N, K / 256] and cs, cm [N, K / 32] (asserting it factors)."""
    module, (n, k) = quant_gemv.cpu_module(), weight.shape
    d, dm = torch.empty(n, k // 256), torch.empty(n, k // 256)
    cs, cm = (torch.empty(n, k // 32, dtype=torch.uint8) for _ in range(2))
    scales, mins = weight.scales.float().contiguous(), weight.mins.float().contiguous()
    assert module.factor_int4_scales(
        scales=scales.data_ptr(), mins=mins.data_ptr(), n=n, k=k, d=d.data_ptr(),
        dm=dm.data_ptr(), cs=cs.data_ptr(), cm=cm.data_ptr(),
    )  # fmt: skip
    return d, dm, cs, cm


def _raw_gemv(x: torch.Tensor, weight: QuantizedWeight, fmt: str, path: str, bits: int):
    """The module's pack and gemv for tiles of `fmt` (int4_k, int5_g32, or int4 for fp16
    values), into rows of N + PAD poisoned columns."""
    module, (n, k) = quant_gemv.cpu_module(), weight.shape
    code = module.FORMATS[fmt]
    tiles = torch.empty(module.packed_bytes(format=code, n=n, k=k), dtype=torch.uint8)
    if fmt == "int4_k":
        d, dm, cs, cm = _factored(weight)
        module.pack_int4_k(
            out=tiles.data_ptr(), qweight=weight.qweight.data_ptr(), cs=cs.data_ptr(),
            cm=cm.data_ptr(), d=d.data_ptr(), dm=dm.data_ptr(), n=n, k=k,
        )  # fmt: skip
    elif fmt == "int5_g32":
        codes = weight.unpacked_int4().contiguous()
        scales, mins = weight.scales.float().contiguous(), weight.mins.float().contiguous()
        module.pack_int5(
            out=tiles.data_ptr(), qweight=codes.data_ptr(), scales=scales.data_ptr(),
            mins=mins.data_ptr(), n=n, k=k,
        )  # fmt: skip
    else:
        scales, mins = weight.scales.half().contiguous(), weight.mins.half().contiguous()
        module.pack_int4(
            out=tiles.data_ptr(), qweight=weight.qweight.data_ptr(), scales=scales.data_ptr(),
            mins=mins.data_ptr(), n=n, k=k, group=32, format=code,
        )  # fmt: skip
    return tiles, cpu_gemv_into_poisoned(module, code, tiles, x, n, path, bits, PAD)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int4_k_tiles_give_the_int5_g32_tiles_bits(m, n, k, path, bits):
    weight = _q4k_weight(n, k, seed=m * 7 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n * k)) * 2.0
    k_tiles, got_k = _raw_gemv(x, weight, "int4_k", path, bits)
    five_tiles, want = _raw_gemv(x, weight, "int5_g32", path, bits)
    tiles = (n + 15) // 16
    assert k_tiles.numel() == tiles * (k // 256) * 2432  # 4.75 bits a weight
    assert five_tiles.numel() == tiles * (k // 32) * 448
    assert not want.isnan().any() and torch.equal(got_k, want)
    assert_quant_gemv_picks(weight, "int4_k", k_tiles, x, want, path, bits)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
def test_int4_k_tiles_give_the_int4_tiles_bits_on_fp16_values(path, bits):
    """Scales and mins that fp16 holds (d of 4 significant bits times a 6-bit c): int4_k and the
    fp16 int4 tiles carry the same values, so the same bits; quant_gemv takes the smaller."""
    n, k = 41, 512
    weight = _q4k_weight(n, k, seed=11)
    for part in (weight.scales, weight.mins):
        rounded = part.view(n, k // 256, 8)
        top = rounded.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        d = (top / 63).log2().floor().exp2()  # a power of two: every c * d fits fp16
        rounded.copy_((rounded / d).round() * d)
    assert torch.equal(weight.scales.half().float(), weight.scales)
    x = torch.randn(4, k)
    _, want = _raw_gemv(x, weight, "int4", path, bits)
    _, got_k = _raw_gemv(x, weight, "int4_k", path, bits)
    assert not want.isnan().any() and torch.equal(got_k, want)
    assert quant_gemv.tile_format(weight) == "int4_k"
    assert torch.equal(quant_gemv.quant_gemv(x, weight, path=path, activation_bits=bits), want)


def _two_level(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (c.float().view(*d.shape, 8) * d[..., None]).view(c.shape)


def test_factoring_recovers_exact_scales_and_mins_of_every_kind():
    """Q4_K's form (the largest c 63) and others (the largest 61, 255, 1; d of either sign, not
    fp16, tiny and huge: any d whose products with a byte are exact in fp32), all-zero and
    signed-zero super-blocks: each factors, and c * d gives each value back bit for bit."""
    g = torch.Generator().manual_seed(3)
    n, k = 12, 512
    c = torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 256, generator=g) + 0.01).half().float()
    view = c.view(n, -1, 8)
    view[0, :, 5] = 63
    view[1] = torch.randint(0, 62, (k // 256, 8), generator=g)
    view[1, :, 2] = 61
    view[2] = torch.randint(0, 256, (k // 256, 8), generator=g)
    view[2, :, 7] = 255
    view[3] = 1
    d[4] = -d[4]  # mins' sign
    d[5] = (torch.rand(k // 256, generator=g) * 2**15).round() * 2.0**-120  # not fp16, tiny
    d[6] = d[6] * 2.0**100
    view[7, 0] = 0  # an all-zero super-block
    values = _two_level(d, c)
    values[8, :8] = -0.0
    other = _two_level(d.flip(0), c.flip(0))
    for scales, mins in ((values, other), (other, values)):
        weight = QuantizedWeight("int4", (n, k), torch.zeros(n, k // 2, dtype=torch.uint8),
                                 scales, mins, 32)  # fmt: skip
        got_d, got_dm, got_cs, got_cm = _factored(weight)
        for want, back in ((scales, _two_level(got_d, got_cs)), (mins, _two_level(got_dm, got_cm))):
            assert torch.equal(back, want)  # == treats -0 as 0; the bits of every non-zero one:
            nonzero = want != 0
            assert torch.equal(back[nonzero].view(torch.int32), want[nonzero].view(torch.int32))
        assert quant_gemv.tile_format(weight) == "int4_k"


@pytest.mark.parametrize(
    "case, fmt",
    [
        ("random_fp32", "int5_g32"),  # no byte c times one d gives these
        ("nan", "int5_g32"),
        ("inf", "int5_g32"),
        ("k_not_256", "int5_g32"),
        ("fp16_random", "int4"),  # fp16 values that do not factor: int4, as before
        ("fp16_symmetric", "int4_sym"),  # m = -8 d (GGUF Q4_0)
        ("g128", "int4_k"),  # G = 128's pairs repeat over their four blocks of 32
        ("bf16", "int4_k"),  # any float dtype: its values, in fp32
    ],
)
def test_quant_gemv_picks_the_smallest_exact_tiles(case, fmt):
    n, k = 20, 512 if case != "k_not_256" else 288
    weight = _q4k_weight(n, 512, seed=4)
    if case == "k_not_256":
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales, mins = torch.rand(n, k // 32) * 1e-2, -torch.rand(n, k // 32) * 1e-2
        weight = QuantizedWeight("int4", (n, k), _pack_nibbles(codes), scales, mins, 32)
    elif case == "random_fp32":
        weight.scales[7, 8:16] = torch.rand(8) + 0.5
    elif case == "nan":
        weight.scales[7, 3] = float("nan")
    elif case == "inf":
        weight.mins[0, 13] = float("-inf")
    elif case.startswith("fp16"):
        weight.scales = (torch.rand(n, k // 32) * 1e-2 + 1e-3).half()
        weight.mins = (-8 * weight.scales) if case == "fp16_symmetric" else -weight.scales * 3.3
    elif case == "g128":
        weight.scales = weight.scales[:, ::4].contiguous()
        weight.mins = weight.mins[:, ::4].contiguous()
        weight.group_size = 128
    elif case == "bf16":
        weight.scales = (torch.randint(1, 64, (n, k // 32)) * 2.0**-9).bfloat16()
        weight.mins = (torch.randint(0, 64, (n, k // 32)) * -(2.0**-7)).bfloat16()
    assert quant_gemv.tile_format(weight) == fmt
    if case in ("nan", "inf"):
        return
    x = torch.randn(3, k)
    got = quant_gemv.quant_gemv(x, weight).double()
    exact = ref_quant_linear(x.double(), weight)
    assert ((got - exact).norm() / exact.norm()).item() < 1e-4
    if fmt in ("int5_g32", "int4_k") and weight.group_size == 32:
        _, want = _raw_gemv(x, weight, "int5_g32", quant_gemv.best_path(), 16)
        assert torch.equal(got, want.double())
