"""The CPU backend's quantized GEMM (csrc/cpu/ through ops/cpu/quant_gemv.py) against the
float64 reference, as kernels are tested: fresh random inputs, odd shapes, the output poisoned
with NaN, on every ISA path this machine runs (forced by argument and by the cpu_gemv_isa
variant), with 16-bit and 8-bit activations. The activations are quantized per block of 32, so
the bound is that rounding's worst case (half a step of each block, times the block's |w|) plus
fp32 accumulation; every path must give the same bits, and a row's result must not depend on
M, the other rows or the threads."""

from __future__ import annotations

import pytest
import torch
from kernel_check import poisoned, six_bit_weight

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_int4, quantize_int8, quantize_int8_grouped
from pagedkern.ops import variants
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.cpu import quant_linear as cpu_quant_linear
from pagedkern.ops.variants import use_kernels
from pagedkern.reference.quant_gemm import dequantize
from pagedkern.reference.quant_gemm import quant_linear as ref_quant_linear
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

# ("int5", 32): int8 codes 0..31 with a scale and a min per 32 (GGUF Q5_*: int5_g32 tiles)
FORMATS = [("int8", 0), ("int4", 32), ("int4", 128), ("int8", 32), ("int8", 16), ("int5", 32)]
QMAX = {8: 127, 16: 32639}  # the largest quantized activation (csrc/cpu/activations.cpp)
SHAPES = [(1, 37, 64), (3, 960, 256), (5, 16, 128), (17, 50, 384), (64, 33, 32)]


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _weight(fmt: str, group: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)
    if fmt == "int5":  # Q5_K's form: s = d sc, m = -dmin mn (fp16 d, dmin; 6-bit sc, mn)
        d = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-4).half().float()
        sc = torch.randint(1, 64, (n, k // 32), generator=g).float()
        scales = d * sc
        mins = -(d * torch.randint(0, 64, (n, k // 32), generator=g).float())
        q = torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8)
        q[0, 0], q[-1, -1] = 0, 31
        return QuantizedWeight("int8", (n, k), q, scales, mins, 32)
    if fmt == "int8" and group:  # a scale per group along K (GGUF Q8_0: 32, Q6_K: 16)
        return quantize_int8_grouped(w, group)
    return quantize_int8(w) if fmt == "int8" else quantize_int4(w, group)


def _bound(x: torch.Tensor, qw, bits: int = 8) -> torch.Tensor:
    """Worst case of per-block activation rounding (|dx q - x| <= dx / 2 with dx = the block's
    max |x| / QMAX) plus fp32 accumulation slack (K terms of 2^-24 relative)."""
    m, k = x.shape
    w = dequantize(qw).abs()  # [N, K] float64
    step = x.double().abs().view(m, k // 32, 32).amax(-1) / QMAX[bits]
    half_step = (step / 2).repeat_interleave(32, 1)
    terms = x.double().abs() @ w.T
    return half_step @ w.T * 1.001 + terms * (k + 8) * 2**-24 + 1e-30


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_the_reference_within_the_activation_rounding(path, fmt, group, m, n, k, bits):
    if fmt == "int4":
        k = -(-k // group) * group  # whole groups
    qw = _weight(fmt, group, n, k, seed=m * 131 + n + k)
    if fmt == "int5":
        assert quant_gemv.tile_format(qw) == "int5_g32"
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n + k)) * 2.0
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    out = poisoned((m, n), torch.float32, "cpu")
    got = quant_gemv.quant_gemv(x, qw, path=path, out=out, activation_bits=bits)
    assert got is out and not torch.isnan(out).any()
    want = ref_quant_linear(x.double(), qw)
    assert ((got.double() - want).abs() <= _bound(x, qw, bits)).all()


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_16_bit_activations_are_closer_than_bf16(fmt, group):
    """The default width's error is far below bf16 activations' (torch's int-pack kernels)."""
    qw = _weight(fmt, group, 96, 512, seed=11)
    x = torch.randn(4, 512)
    want = ref_quant_linear(x.double(), qw)
    err16 = (quant_gemv.quant_gemv(x, qw).double() - want).abs().max()
    err8 = (quant_gemv.quant_gemv(x, qw, activation_bits=8).double() - want).abs().max()
    err_bf16 = (ref_quant_linear(x.bfloat16().double(), qw) - want).abs().max()
    assert err16 * 20 < err_bf16 and err16 * 100 < err8


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_every_path_gives_the_same_bits(fmt, group, bits):
    """37 rows: the AMX path's two groups of 16 and its 5 rows left on the VNNI kernel."""
    qw = _weight(fmt, group, 75, 256, seed=3)
    x = torch.randn(37, 256)
    x[1, 40] = x[1, 32:64].abs().max() * -1.0  # a block's extreme: q = -QMAX
    x[20, 70] = x[20, 64:96].abs().max()  # (in the second group: q = +QMAX)
    results = [quant_gemv.quant_gemv(x, qw, path=p, activation_bits=bits) for p in _paths()]
    assert "portable" in _paths() and len(results) >= 1
    for other in results[1:]:
        assert torch.equal(other, results[0])


@pytest.mark.skipif("avx512_amx" not in _paths(), reason="no AMX tiles on this CPU (or kernel)")
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(
    "fmt", ["int4", "int4_sym", "int5_g32", "int8", "int8_g32", "int8_g16", "int6_g16", "int6_k"]
)
def test_amx_tiles_give_the_vnni_bits_at_every_row_count(fmt, bits):
    """The AMX path computes whole groups of 16 rows from a format's threshold (the rest, and
    fewer rows, on the VNNI kernel) from a copy of the quantized rows made per call: row counts
    around the groups and the thresholds, each call after a larger or smaller one."""
    source = {"int8_g32": ("int8", 32), "int8": ("int8", 0), "int5_g32": ("int5", 32),
              "int8_g16": ("int8", 16)}  # fmt: skip
    k = 512 if fmt == "int6_k" else 320  # int6_k's scales factor per 256 along K
    qw = six_bit_weight(70, k, seed=12) if fmt.startswith("int6") else (
        _weight(*source.get(fmt, ("int4", 32)), 70, k, seed=12))  # fmt: skip
    if fmt == "int4_sym":
        qw.mins = (-8 * qw.scales.float()).half()
    if fmt in ("int8", "int8_g32", "int8_g16"):  # both extremes of the codes
        qw.qweight[0, :2] = torch.tensor([-127, 127], dtype=torch.int8)
    if fmt == "int5_g32":  # every fifth bit's position set and clear in one row
        qw.qweight[1, :64] = torch.tensor([31, 0] * 16 + [0, 31] * 16, dtype=torch.int8)
    if fmt.startswith("int6"):  # every high part in every K-quad of one row, both code ends
        qw.qweight[1, :64] = torch.arange(64, dtype=torch.int8) - 32
        qw.qweight[2, :64] = 31 - torch.arange(64, dtype=torch.int8)
    assert quant_gemv.tile_format(qw) == fmt
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(12))
    for m in (100, 15, 16, 33, 31, 32, 48, 17, 64):
        rows = x[m % 7 : m % 7 + m]
        amx = quant_gemv.quant_gemv(rows, qw, path="avx512_amx", activation_bits=bits)
        vnni = quant_gemv.quant_gemv(rows, qw, path="avx512_vnni", activation_bits=bits)
        assert torch.equal(amx, vnni), m


def test_the_isa_variant_forces_a_path(monkeypatch):
    qw = _weight("int4", 32, 40, 64, seed=4)
    x = torch.randn(2, 64)
    seen = []
    module = quant_gemv.cpu_module()
    real_gemv = module.gemv
    monkeypatch.setattr(
        quant_gemv,
        "cpu_module",
        lambda: _Spy(module, lambda **kw: seen.append(kw["path"]) or real_gemv(**kw)),
    )
    for path in _paths():
        with use_kernels(cpu_gemv_isa=path):
            assert quant_gemv.best_path() == path
            quant_gemv.quant_gemv(x, qw)
    assert seen == [module.PATHS[p] for p in _paths()]
    with use_kernels(cpu_gemv_isa="auto"):
        assert quant_gemv.best_path() == _paths()[-1]


class _Spy:
    def __init__(self, module, gemv):
        self._module, self.gemv = module, gemv

    def __getattr__(self, name):
        return getattr(self._module, name)


def test_a_path_this_cpu_lacks_is_an_error_not_a_crash():
    missing = [p for p in quant_gemv.PATHS if p not in _paths()]
    if not missing:
        pytest.skip("this CPU runs every path")
    qw = _weight("int4", 32, 16, 64, seed=0)
    with pytest.raises(RuntimeError, match=missing[0]):
        quant_gemv.quant_gemv(torch.randn(1, 64), qw, path=missing[0])


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_a_row_does_not_depend_on_its_batch_or_the_threads(path, fmt, group):
    qw = _weight(fmt, group, 100, 256, seed=5)
    x = torch.randn(9, 256)
    whole = quant_gemv.quant_gemv(x, qw, path=path, threads=1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the GEMV's threads are torch's OpenMP team
        for i in range(9):
            alone = quant_gemv.quant_gemv(x[i : i + 1], qw, path=path, threads=2)
            assert torch.equal(alone[0], whole[i])
        assert torch.equal(quant_gemv.quant_gemv(x[2:7], qw, path=path, threads=3), whole[2:7])
    finally:
        torch.set_num_threads(previous)
    strided = torch.zeros(9, 400)
    strided[:, 8:264] = x  # rows of stride 400, unit stride along K
    assert torch.equal(quant_gemv.quant_gemv(strided[:, 8:264], qw, path=path), whole)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt,group", [*FORMATS, ("int4_sym", 32)])
def test_rows_sharing_a_weight_load_keep_their_own_bits(fmt, group, bits):
    """The x86 kernels run rows in chunks (up to 8) over each weight load: every batch size
    from 1 to 19 splits into different chunks, and each row must equal itself alone."""
    qw = _weight("int4" if fmt == "int4_sym" else fmt, group, 40, 128, seed=9)
    if fmt == "int4_sym":  # GGUF Q4_0's shape: the tiles without mins
        qw.mins = (-8 * qw.scales.float()).half()
        assert quant_gemv.tile_format(qw) == "int4_sym"
    x = torch.randn(19, 128)
    for path in _paths():
        alone = [quant_gemv.quant_gemv(x[i : i + 1], qw, path=path, activation_bits=bits)[0]
                 for i in range(19)]  # fmt: skip
        for m in range(1, 20):
            batch = quant_gemv.quant_gemv(x[:m], qw, path=path, activation_bits=bits)
            for i in range(m):
                assert torch.equal(batch[i], alone[i]), (path, m, i)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt,group", [*FORMATS, ("int4_sym", 32)])
def test_tiles_read_together_keep_their_own_bits(fmt, group, bits):
    """At up to 4 rows the x86 kernels read several weight tiles at once (AVX-512 int4 and
    int8, and the 256-bit kernels' EVEX build: 8, 4 or 2; AVX2, AVX-VNNI: 4 or 2), their
    blocks interleaved, and a thread's last tiles one by one: 1 to 5 rows of 22 tiles (the
    last partial) on 1 and 2 threads, into a poisoned out, give the portable path's bits."""
    n, k = 16 * 21 + 5, 256
    qw = _weight("int4" if fmt == "int4_sym" else fmt, group, n, k, seed=21)
    if fmt == "int4_sym":
        qw.mins = (-8 * qw.scales.float()).half()
        assert quant_gemv.tile_format(qw) == fmt
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(22))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the GEMV's threads are torch's OpenMP team
        for m in range(1, 6):
            want = quant_gemv.quant_gemv(x[:m], qw, path="portable", activation_bits=bits)
            assert not want.isnan().any()
            for path in _paths():
                for threads in (1, 2):
                    buffer = poisoned((m * n + 16,), torch.float32, "cpu")
                    out = buffer[: m * n].view(m, n)
                    quant_gemv.quant_gemv(
                        x[:m], qw, path=path, out=out, threads=threads, activation_bits=bits
                    )
                    assert torch.equal(out, want), (path, m, threads)
                    assert buffer[m * n :].isnan().all(), "a column past N was written"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_nan_in_a_row_reaches_its_outputs_only(fmt, group):
    qw = _weight(fmt, group, 40, 128, seed=7)
    x = torch.randn(3, 128)
    x[1, 70] = float("nan")
    for path in _paths():
        got = quant_gemv.quant_gemv(x, qw, path=path)
        assert torch.isnan(got[1]).all()
        assert torch.isfinite(got[[0, 2]]).all()


def test_int8_with_mins_needs_5_bit_codes_per_32():
    """The int5_g32 tiles take codes 0..31 with a scale and a min per 32, nothing else."""
    qw = _weight("int5", 32, 16, 64, seed=8)
    bad = QuantizedWeight("int8", qw.shape, qw.qweight.clone(), qw.scales, qw.mins, 32)
    bad.qweight[3, 5] = 32
    with pytest.raises(ValueError, match="codes in 0..31"):
        quant_gemv.packed(bad)
    bad.qweight[3, 5] = -1
    with pytest.raises(ValueError, match="codes in 0..31"):
        quant_gemv.packed(bad)
    scales16 = qw.scales.repeat_interleave(2, dim=1)
    sixteen = QuantizedWeight("int8", qw.shape, qw.qweight, scales16, scales16, 16)
    with pytest.raises(ValueError, match="group_size 32"):
        quant_gemv.packed(sixteen)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    """The variants at their defaults (the C++ GEMM with 16-bit activations, the best path)."""
    monkeypatch.delenv(variants.ENV_NAME, raising=False)


def test_the_int_pack_variant_runs_torch_int_pack(monkeypatch):
    qw = _weight("int4", 32, 48, 64, seed=1)
    x = torch.randn(2, 64)
    calls = []
    real = quant_gemv.quant_gemv
    monkeypatch.setattr(quant_gemv, "quant_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    with use_kernels(cpu_quant_linear="int_pack"), ops.use_backend("cpu"):
        got = ops.quant_linear(x, qw)
    assert calls == []
    with ops.use_backend("reference"):
        assert torch.equal(got, ops.quant_linear(x, qw))


def test_the_backend_runs_it_and_the_reference_backend_does_not(monkeypatch):
    qw = _weight("int4", 32, 48, 64, seed=1)
    x = torch.randn(2, 64)
    calls = []
    real = quant_gemv.quant_gemv
    monkeypatch.setattr(quant_gemv, "quant_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    bias = torch.randn(48)
    with ops.use_backend("cpu"):
        got = ops.quant_linear(x, qw, bias)
    assert calls == [1]
    assert torch.equal(got, real(x, qw) + bias)
    with ops.use_backend("reference"):
        ops.quant_linear(x, qw)  # torch's int-pack kernels
    assert calls == [1]
    half = ops.quant_linear(x.bfloat16(), qw)  # fp32 inside, rounded once to x's dtype
    want = real(x.bfloat16().float(), qw).bfloat16()
    assert half.dtype == torch.bfloat16 and torch.equal(half, want)


def test_without_the_module_torch_int_pack_runs_with_a_warning(monkeypatch):
    qw = _weight("int8", 0, 32, 64, seed=2)
    x = torch.randn(3, 64)
    monkeypatch.setattr(quant_gemv, "_probe", lambda: (None, "pagedkern._cpu is not built"))
    monkeypatch.setattr(cpu_quant_linear, "_warned", False)
    with pytest.warns(RuntimeWarning, match="not built"), ops.use_backend("cpu"):
        got = ops.quant_linear(x, qw)
    with ops.use_backend("reference"):
        assert torch.equal(got, ops.quant_linear(x, qw))
    with pytest.raises(RuntimeError, match="not built"):
        quant_gemv.quant_gemv(x, qw)


def test_arguments_are_checked():
    qw = _weight("int4", 32, 16, 64, seed=0)
    with pytest.raises(ValueError, match="K must equal"):
        quant_gemv.quant_gemv(torch.randn(2, 32), qw)
    with pytest.raises(ValueError, match="float32"):
        quant_gemv.quant_gemv(torch.randn(2, 64).double(), qw)
    with pytest.raises(ValueError, match="path"):
        quant_gemv.quant_gemv(torch.randn(2, 64), qw, path="avx9")
    with pytest.raises(ValueError, match="out"):
        quant_gemv.quant_gemv(torch.randn(2, 64), qw, out=torch.empty(2, 15))


def test_the_int8_variant_runs_8_bit_activations():
    qw = _weight("int4", 32, 48, 64, seed=6)
    x = torch.randn(3, 64)
    with use_kernels(cpu_quant_linear="int8_activations"), ops.use_backend("cpu"):
        got = ops.quant_linear(x, qw)
    assert torch.equal(got, quant_gemv.quant_gemv(x, qw, activation_bits=8))
    assert not torch.equal(got, quant_gemv.quant_gemv(x, qw))


@pytest.mark.parametrize("fmt", ["int6_k", "int4_k"])
def test_two_level_tiles_refuse_k_not_a_multiple_of_256(fmt):
    module = quant_gemv.cpu_module()
    code = module.FORMATS[fmt]
    with pytest.raises(ValueError, match="256"):
        module.packed_bytes(format=code, n=16, k=288)
    x, y, tiles = torch.randn(1, 288), torch.empty(1, 16), torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="256"):
        module.gemv(
            format=code, y=y.data_ptr(), y_stride=16, x=x.data_ptr(), x_stride=288,
            packed=tiles.data_ptr(), scales=0, m=1, n=16, k=288, threads=1, path=-1,
            activation_bits=16,
        )  # fmt: skip


@pytest.mark.parametrize(
    "case, part",
    [
        ("int4 scales one group short", "scales"),
        ("int4 mins missing", "mins"),
        ("int4 qweight int8", "qweight"),
        ("int4 qweight a row short", "qweight"),
        ("int8 per-channel scales of groups", "scales"),
        ("int8 grouped scales per channel", "scales"),
        ("int8 integer scales", "scales"),
        ("int8 group 64", "group_size"),
        ("K not a multiple of 32", "multiple of 32"),
    ],
)
def test_malformed_weights_are_refused_before_the_pack_reads_them(case, part):
    """The pack reads the parts by address: a part of the wrong shape or dtype would be read
    out of bounds, so the call refuses it, naming the part."""
    n, k = 20, 64
    four = quantize_int4(torch.randn(n, k), 32)
    eight = quantize_int8(torch.randn(n, k))
    grouped = quantize_int8_grouped(torch.randn(n, k), 32)
    weight = {
        "int4 scales one group short": QuantizedWeight(
            "int4", (n, k), four.qweight, four.scales[:, :1], four.mins, 32
        ),
        "int4 mins missing": QuantizedWeight("int4", (n, k), four.qweight, four.scales, None, 32),
        "int4 qweight int8": QuantizedWeight(
            "int4", (n, k), four.qweight.view(torch.int8), four.scales, four.mins, 32
        ),
        "int4 qweight a row short": QuantizedWeight(
            "int4", (n, k), four.qweight[1:], four.scales, four.mins, 32
        ),
        "int8 per-channel scales of groups": QuantizedWeight(
            "int8", (n, k), eight.qweight, grouped.scales
        ),
        "int8 grouped scales per channel": QuantizedWeight(
            "int8", (n, k), grouped.qweight, eight.scales, None, 32
        ),
        "int8 integer scales": QuantizedWeight(
            "int8", (n, k), eight.qweight, eight.scales.to(torch.int32)
        ),
        "int8 group 64": QuantizedWeight("int8", (n, k), grouped.qweight, grouped.scales, None, 64),
        "K not a multiple of 32": QuantizedWeight(
            "int8", (n, 48), eight.qweight[:, :48], eight.scales
        ),
    }[case]
    with pytest.raises(ValueError, match=part):
        quant_gemv.quant_gemv(torch.randn(2, weight.shape[1]), weight)
    assert quant_gemv._PACKED_KEY not in weight.packed
