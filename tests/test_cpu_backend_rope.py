"""The CPU backend's rope_and_cache (ops/cpu/rope.py: the C++ call for fp32 rows and caches,
and the torch ops, each) against reference.rope_and_cache: q, k and the cache pages bit for bit
(the same products and sums), over odd shapes, q/k/v as views of one fused QKV output and as
separate tensors, one cache allocation or two, skipped slots, bf16, fp16 and fp8 caches,
QK-norm, and a step's rows reused by its later layers but never by a call with other positions
or slots."""

from __future__ import annotations

import pytest
import torch

from pagedkern import ops, reference
from pagedkern.ops.cpu import quant_gemv, rope

BLOCK = 16


@pytest.fixture(autouse=True, params=["cpp", "torch"])
def path(request, monkeypatch):
    """Each test on both paths: csrc/cpu/rope_cache.cpp where it applies, and the torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(rope, "_in_cpp", lambda *args: False)
    elif not quant_gemv.available():
        pytest.skip("pagedkern._cpu is not built")
    return request.param


def _case(tokens, hq, hkv, d, fused, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    else:
        q, k, v = (torch.randn(tokens, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    positions = torch.randint(0, 300, (tokens,), generator=g, dtype=torch.int32)
    slots = torch.randperm(7 * BLOCK, generator=g)[:tokens].to(torch.int32)
    return q, k, v, positions, slots


def _caches(hkv, d, dtype, separate=False):
    data = torch.full((2, 7, hkv, BLOCK, d), float("nan")).to(dtype)  # poisoned: unwritten NaN
    if separate:  # two allocations (whose distance is no stride), viewed together afterwards
        k_cache, v_cache = data[0].clone(), data[1].clone()
        return _Pair(k_cache, v_cache), k_cache, v_cache
    return data, data[0], data[1]


class _Pair:
    """Two separate caches read as one [2, ...] tensor once written."""

    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache = k_cache, v_cache

    def float(self):
        return torch.stack([self.k_cache.float(), self.v_cache.float()])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    ("tokens", "hq", "hkv", "d"),
    [(1, 9, 3, 64), (5, 4, 4, 16), (13, 6, 2, 32), (rope._FEW + 8, 4, 2, 16)],  # host, tensors
)
@pytest.mark.parametrize("cache", ["same", "fp8", "bfloat16", "float16", "separate"])
@pytest.mark.parametrize("skipped", [True, False])
def test_matches_the_reference(fused, tokens, hq, hkv, d, cache, skipped):
    q, k, v, positions, slots = _case(tokens, hq, hkv, d, fused, tokens * hq + d)
    if skipped:
        slots[tokens // 2] = -1  # a row not written
    cos_sin = reference.cos_sin_cache(d, 512)
    dtype = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtype.get(cache, torch.float32)  # (16-bit caches under fp32 rows: K/V rounded)
    scales = dict(k_scale=0.37, v_scale=1.9) if cache == "fp8" else {}
    want_q, want_k, want_v = q.clone(), k.clone(), v.clone()
    want_data, want_kc, want_vc = _caches(hkv, d, dtype)
    reference.rope_and_cache(
        want_q, want_k, want_v, positions, cos_sin, want_kc, want_vc, slots, **scales
    )
    got_data, got_kc, got_vc = _caches(hkv, d, dtype, separate=cache == "separate")
    rope.rope_and_cache(q, k, v, positions, cos_sin, got_kc, got_vc, slots, **scales)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)
    torch.testing.assert_close(got_data.float(), want_data.float(), rtol=0, atol=0, equal_nan=True)
    assert got_data.float().isnan().any()  # the poison stayed where nothing was written


def test_qk_norm_and_half_precision_through_the_op():
    q, k, v, positions, slots = _case(6, 4, 2, 32, True, 3, torch.bfloat16)
    cos_sin = reference.cos_sin_cache(32, 512)
    q_norm, k_norm = torch.rand(32).bfloat16() + 0.5, torch.rand(32).bfloat16() + 0.5
    want = [t.clone() for t in (q, k, v)]
    want_data, want_kc, want_vc = _caches(2, 32, torch.bfloat16)
    with ops.use_backend("reference"):
        ops.rope_and_cache(
            *want, positions, cos_sin, want_kc, want_vc, slots, q_norm=q_norm, k_norm=k_norm
        )
    got_data, got_kc, got_vc = _caches(2, 32, torch.bfloat16)
    with ops.use_backend("cpu"):
        ops.rope_and_cache(
            q, k, v, positions, cos_sin, got_kc, got_vc, slots, q_norm=q_norm, k_norm=k_norm
        )
    for got, ref in zip((q, k, got_data), (want[0], want[1], want_data), strict=True):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


@pytest.mark.parametrize(("tokens", "d"), [(1, 64), (7, 40), (rope._FEW + 3, 128)])
def test_fp32_qk_norm_matches_the_reference(path, tokens, d, monkeypatch):
    """fp32 QK-norm: on the C++ path inside the one call (csrc/cpu/rms.h's sums: within 1e-6 of
    torch's), on the torch path by torch.rms_norm; then the rotation and the stores."""
    q, k, v, positions, slots = _case(tokens, 5, 1, d, True, tokens + d)
    cos_sin = reference.cos_sin_cache(d, 512)
    g = torch.Generator().manual_seed(d)
    q_norm, k_norm = (torch.rand(d, generator=g) + 0.5 for _ in "qk")
    want = [t.clone() for t in (q, k, v)]
    want[0].copy_(reference.rms_norm(want[0], q_norm, 1e-5))
    want[1].copy_(reference.rms_norm(want[1], k_norm, 1e-5))
    want_data, want_kc, want_vc = _caches(1, d, torch.float32)
    reference.rope_and_cache(*want, positions, cos_sin, want_kc, want_vc, slots)
    calls = []
    if path == "cpp":
        module = quant_gemv.cpu_module()
        real = module.rope_cache
        monkeypatch.setattr(module, "rope_cache", lambda **kw: calls.append(kw) or real(**kw))
    got_data, got_kc, got_vc = _caches(1, d, torch.float32)
    rope.begin_step()
    rope.rope_and_cache(
        q, k, v, positions, cos_sin, got_kc, got_vc, slots, q_norm=q_norm, k_norm=k_norm,
        norm_eps=1e-5,
    )  # fmt: skip
    assert [c["q_norm"] != 0 for c in calls] == ([True] if path == "cpp" else [])
    for got, ref in zip((q, k, got_data), (want[0], want[1], want_data), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert got_data.isnan().any() and not q.isnan().any()


def test_a_steps_rows_are_reused_within_the_step_only():
    q, k, v, positions, slots = _case(4, 4, 2, 16, True, 5)
    cos_sin = reference.cos_sin_cache(16, 512)
    _, kc, vc = _caches(2, 16, torch.float32)
    rope.begin_step()
    rope.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots)
    first = rope._rows(positions, cos_sin, slots, BLOCK)
    rope.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots)
    assert rope._rows(positions, cos_sin, slots, BLOCK) is first  # a later layer: the same
    positions[0] += 1  # refilled in place for another step
    want_q, want_k, want_v = q.clone(), k.clone(), v.clone()
    want_data, want_kc, want_vc = _caches(2, 16, torch.float32)
    reference.rope_and_cache(want_q, want_k, want_v, positions, cos_sin, want_kc, want_vc, slots)
    with ops.use_backend("cpu"):  # the op starts a step on every call
        ops.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots)
    assert rope._rows(positions, cos_sin, slots, BLOCK) is not first
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_fp32_rows_take_one_cpp_call(path, monkeypatch):
    q, k, v, positions, slots = _case(5, 4, 2, 16, True, 6)
    cos_sin = reference.cos_sin_cache(16, 512)
    _, kc, vc = _caches(2, 16, torch.float32)
    calls = []
    module = quant_gemv.cpu_module() if quant_gemv.available() else None
    if module is not None:
        real = module.rope_cache
        monkeypatch.setattr(module, "rope_cache", lambda **kw: calls.append(kw) or real(**kw))
    rope.begin_step()
    rope.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots)
    assert len(calls) == (1 if path == "cpp" else 0)


@pytest.mark.parametrize("bad", ["position", "slot"])
def test_an_index_out_of_range_is_refused_before_anything_is_written(path, bad):
    if path == "torch":
        pytest.skip("the torch ops index (and refuse) as torch does")
    q, k, v, positions, slots = _case(4, 4, 2, 16, True, 7)
    cos_sin = reference.cos_sin_cache(16, 64)
    if bad == "position":
        positions[2] = 64
    else:
        slots[3] = 7 * BLOCK
    data, kc, vc = _caches(2, 16, torch.float32)
    before = q.clone()
    rope.begin_step()
    with pytest.raises(IndexError, match="outside the"):
        rope.rope_and_cache(q, k, v, positions, cos_sin, kc, vc, slots)
    assert torch.equal(q, before) and data.isnan().all()


def test_many_rows_split_over_threads_match_the_reference(path):
    """A prefill chunk's hundreds of rows (the C++ call splits them over the threads)."""
    g = torch.Generator().manual_seed(8)
    tokens, hq, hkv, d = 300, 6, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    positions = torch.arange(tokens, dtype=torch.int32) + 5
    slots = torch.randperm(20 * BLOCK, generator=g)[:tokens].to(torch.int32)
    cos_sin = reference.cos_sin_cache(d, 512)
    want_q, want_k, want_v = q.clone(), k.clone(), v.clone()
    want = torch.full((2, 20, hkv, BLOCK, d), float("nan"))
    reference.rope_and_cache(want_q, want_k, want_v, positions, cos_sin, want[0], want[1], slots)
    got = torch.full_like(want, float("nan"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        rope.begin_step()
        rope.rope_and_cache(q, k, v, positions, cos_sin, got[0], got[1], slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_the_e4m3_rounding_is_torchs(path):
    """csrc/cpu/rope_cache.cpp's E4M3 conversion against torch's cast on every E4M3 value, every
    midpoint between neighbours (ties to even), a hair either side of each, and random values
    over the whole range, subnormals and signed zeros included."""
    if path == "torch":
        pytest.skip("the C++ conversion")
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[~values.isnan()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    hair = mids.abs() * 2**-20
    g = torch.Generator().manual_seed(11)
    spread = torch.randn(20000, generator=g) * torch.exp2(
        torch.randint(-12, 9, (20000,), generator=g)
    )
    xs = torch.cat([finite, mids, mids + hair, mids - hair, spread.clamp(-448, 448),
                    torch.tensor([0.0, -0.0, 448.0, -448.0, 2**-10, -(2**-10)])])  # fmt: skip
    module = quant_gemv.cpu_module()
    got = torch.tensor([module.e4m3_from_float(x) for x in xs.tolist()], dtype=torch.uint8)
    want = xs.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(xs[i].item(), got[i].item(), want[i].item()) for i in bad]
    assert module.e4m3_from_float(float("nan")) & 0x7F == 0x7F


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_rounding_is_torchs(path, dtype):
    """csrc/cpu/rope_cache.cpp's bf16 and fp16 conversions against torch's cast on every value
    of the format, every midpoint between neighbours (ties to even), a hair either side of
    each, and random values over fp32's range (subnormals, overflow to infinity, signed zeros);
    NaN stays NaN."""
    if path == "torch":
        pytest.skip("the C++ conversion")
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float()
    finite = values[values.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    hair = mids.abs() * 2**-20 + 2**-140  # (2^-140: a step either side of a zero midpoint)
    g = torch.Generator().manual_seed(12)
    spread = torch.randn(20000, generator=g) * torch.exp2(
        torch.randint(-140, 128, (20000,), generator=g).float()
    )
    specials = [0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65520.0, -65520.0, 65519.99]
    xs = torch.cat([finite, mids, mids + hair, mids - hair, spread, torch.tensor(specials)])
    xs = xs[~xs.isnan()]  # (inf - inf at the top; torch's own casts write NaN two ways)
    module = quant_gemv.cpu_module()
    convert = module.bf16_from_float if dtype == torch.bfloat16 else module.f16_from_float
    got = torch.tensor([convert(x) for x in xs.tolist()], dtype=torch.int32)
    want = xs.to(dtype).view(torch.int16).int() & 0xFFFF
    bad = (got != want).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(xs[i].item(), got[i].item(), want[i].item()) for i in bad]
    nan = torch.tensor([convert(float("nan")), convert(-float("nan"))], dtype=torch.int32)
    assert nan.to(torch.int16).view(dtype).isnan().all()
