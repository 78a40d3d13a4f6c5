"""The fp8 (E4M3) KV cache in the CUDA kernels, run on the CPU through the emulator
(tests/emulator; cuda_fp8.h's software conversions stand in for the sm_89+ cvt instructions):
rope_and_cache's quantizing write bit for bit against reference.rope_and_cache, and decode
attention over fp8 pages, SIMT and tensor-core variants (the mma fragments spelled as shuffles,
mma_fragments.cuh), against the reference over the same fp8 cache and against attention over the
dequantized cache. Fresh random inputs, odd shapes, NaN-poisoned outputs and unowned cache slots.
"""

from __future__ import annotations

import math

import pytest
import torch
from emulator import emulated, unavailable_reason
from kernel_check import REL_TOLERANCE, assert_same_e4m3

import pagedkern
from pagedkern import reference
from pagedkern.ops.paged_attention import decode_kernel
from pagedkern.ops.support import KernelUnsupportedError
from pagedkern.reference import cos_sin_cache
from pagedkern.reference.rope import quantize_e4m3

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

FP8 = torch.float8_e4m3fn


def _qkv(tokens, hq, hkv, d, dtype, off, g, spread=1.0):
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d + off, generator=g) * spread).to(dtype)
    q = qkv[:, off : off + hq * d].view(tokens, hq, d)
    k = qkv[:, off + hq * d : off + (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, off + (hq + hkv) * d :].view(tokens, hkv, d)
    return q, k, v


def _rope_both(q, k, v, positions, cos_sin, k_cache, v_cache, slots, **scales):
    """(emulated kernel's q, k, v, caches), (reference's): same inputs, each on its own copy."""
    expected = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    reference.rope_and_cache(*expected[:3], positions, cos_sin, *expected[3:], slots, **scales)
    got = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    with emulated():
        pagedkern.rope_and_cache(*got[:3], positions, cos_sin, *got[3:], slots, **scales)
    return got, expected


# (dtype, D, misaligned: the scalar path, tokens, Hq, Hkv, block size, k_scale, v_scale)
ROPE = [
    (torch.bfloat16, 128, False, 23, 6, 2, 16, 0.037, 0.0091),
    (torch.float16, 64, False, 9, 8, 1, 32, 1.0, 1.0),
    (torch.bfloat16, 64, True, 17, 6, 3, 8, 0.21, 3.3),
    (torch.float16, 256, False, 5, 4, 4, 16, 0.5, 0.002),
    (torch.bfloat16, 6, False, 11, 3, 1, 16, 0.05, 0.05),  # D/2 = 3: the scalar path
]


@pytest.mark.parametrize("variant", ["v2", "v1"])
@pytest.mark.parametrize("case", range(len(ROPE)))
def test_rope_and_cache_fp8_write_is_bit_exact(case, variant, kernels):
    kernels(rope_and_cache=variant)
    dtype, d, misaligned, tokens, hq, hkv, block_size, k_scale, v_scale = ROPE[case]
    g = torch.Generator().manual_seed(100 + case)
    # spread 8: some |k / k_scale| beyond 448 (saturation), some deep in the subnormals
    q, k, v = _qkv(tokens, hq, hkv, d, dtype, 1 if misaligned else 0, g, spread=8.0)
    positions = torch.randint(0, 2048, (tokens,), generator=g, dtype=torch.int32)
    blocks = -(-tokens // block_size) + 2
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].int()
    slots[::5] = -1
    k_cache = torch.full((blocks, hkv, block_size, d), math.nan).to(FP8)  # poison: 0x7F
    v_cache = k_cache.clone()
    got, want = _rope_both(
        q, k, v, positions, cos_sin_cache(d, 2048), k_cache, v_cache, slots,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    for a, b in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(got[3:], want[3:], strict=True):
        assert_same_e4m3(a, b)
    written = slots[slots >= 0].long()
    stored = want[3][written // block_size, :, written % block_size]
    assert not stored.float().isnan().any()  # every written slot overwrote the poison


def test_e4m3_conversion_special_values_are_bit_exact():
    # The emulator's conversion (cuda_fp8.h's software path, as on sm_80) against torch's
    # saturated cast on the v path (no rotation): ties to even at normal and subnormal
    # midpoints, the saturation threshold, infinities, NaN, signed zeros, underflow.
    specials = [
        1.0625,
        1.1875,
        -1.0625,
        0.0,
        -0.0,
        448.0,
        464.0,
        465.0,
        480.0,
        1e6,
        -1e6,
        math.inf,
        -math.inf,
        math.nan,
        -math.nan,
        2**-10,
        3 * 2**-10,
        5 * 2**-10,
        -(2**-10),
        2**-9,
        2**-7 * 1.0625,
        1e-9,
        -1e-9,
        240.0,
        0.015625,
        0.0146484375,
    ]
    g = torch.Generator().manual_seed(3)
    d = 64
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        vals = torch.tensor(specials * 5)[: 2 * d].to(dtype)
        rand = (torch.randn(3 * d, generator=g) * torch.exp2(torch.randint(-14, 10, (3 * d,),
                generator=g).float())).to(dtype)  # fmt: skip
        rows.append(torch.cat([vals, rand]).view(5, 1, d))
    for v in rows:
        tokens = v.shape[0]
        q = torch.zeros(tokens, 1, d, dtype=v.dtype)
        k = v.clone()
        slots = torch.arange(tokens, dtype=torch.int32)
        cache = torch.zeros(1, 1, 16, d).to(FP8)
        got, want = _rope_both(
            q, k, v, torch.zeros(tokens, dtype=torch.int32), cos_sin_cache(d, 1), cache,
            cache.clone(), slots, k_scale=1.0, v_scale=1.0,
        )  # fmt: skip
        assert_same_e4m3(got[4], want[4])
        assert_same_e4m3(got[3], want[3])
        stored = want[4].float()[0, 0, :tokens].flatten()
        assert stored[v.flatten().float().isinf()].abs().eq(448).all()


def _fp8_paged(seq_lens, hkv, block_size, d, g, k_scale, v_scale):
    """fp8 caches (k / k_scale, v / v_scale of random k, v) in shuffled pages, NaN (0x7F) in
    every slot no sequence owns."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 2, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(needed) + 1), order[-1], dtype=torch.int32)
    k_cache = torch.full((len(order), hkv, block_size, d), math.nan).to(FP8)
    v_cache = k_cache.clone()
    for b, n in enumerate(seq_lens):
        pages, order = order[: needed[b]], order[needed[b] :]
        tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for t in range(n):
            page, slot = pages[t // block_size], t % block_size
            k = torch.randn(hkv, d, generator=g) * 2
            v = torch.randn(hkv, d, generator=g)
            k_cache[page, :, slot] = quantize_e4m3(k, k_scale)
            v_cache[page, :, slot] = quantize_e4m3(v, v_scale)
    return k_cache, v_cache, tables


# (dtype, D, block size, Hq, Hkv, seq_lens, num_splits, k_scale, v_scale)
ATTENTION = [
    (torch.bfloat16, 128, 16, 8, 8, [1, 15, 0, 17, 100], None, 0.02, 0.01),  # GQA 1
    (torch.float16, 128, 16, 8, 2, [33, 0, 129], 3, 0.015, 0.004),  # GQA 4
    (torch.bfloat16, 64, 32, 16, 2, [65, 255, 3], None, 0.01, 0.02),  # GQA 8
    (torch.float16, 64, 64, 8, 1, [200, 7], 2, 0.03, 0.005),  # GQA 8, one KV head
    (torch.bfloat16, 128, 8, 12, 3, [300, 41], 2, 0.02, 0.01),  # GQA 4, small pages
    (torch.float16, 256, 16, 4, 1, [77, 130], 2, 0.01, 0.01),  # D 256 (SIMT only)
    (torch.bfloat16, 64, 16, 9, 9, [257, 1, 31], 3, 0.05, 0.003),  # GQA 1, odd heads
]


@pytest.mark.parametrize("variant", ["simt", "mma"])
@pytest.mark.parametrize("case", range(len(ATTENTION)))
def test_paged_attention_over_fp8_cache(case, variant, kernels):
    dtype, d, block_size, hq, hkv, seq_lens, num_splits, k_scale, v_scale = ATTENTION[case]
    kernels(paged_attention=variant)
    assert decode_kernel(hq // hkv, d) == ("simt" if d == 256 else variant)
    g = torch.Generator().manual_seed(200 + case)
    k_cache, v_cache, tables = _fp8_paged(seq_lens, hkv, block_size, d, g, k_scale, v_scale)
    batch = len(seq_lens)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(batch, hq, d)  # a fused-QKV view
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full((batch, hq, d), math.nan, dtype=dtype)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    with emulated():
        result, lse = pagedkern.paged_attention(
            q, k_cache, v_cache, tables, lens, out=out, return_lse=True, num_splits=num_splits,
            **scales,
        )  # fmt: skip
    assert result is out
    assert not out.isnan().any()
    # 1. the reference over the same fp8 cache (fp32 math)
    ref, ref_lse = reference.paged_attention(
        q.double(), k_cache, v_cache, tables, lens, return_lse=True, **scales
    )
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err <= REL_TOLERANCE[dtype], err
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # 2. attention over the dequantized cache, in float64
    k_deq, v_deq = k_cache.double() * k_scale, v_cache.double() * v_scale
    deq, deq_lse = reference.paged_attention(
        q.double(), k_deq, v_deq, tables, lens, return_lse=True
    )
    err = float((out.double() - deq).norm() / deq.norm())
    assert err <= REL_TOLERANCE[dtype], err
    torch.testing.assert_close(lse.double(), deq_lse.double(), rtol=1e-5, atol=1e-5)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


def test_paged_attention_fp8_scales_change_the_kernel_result():
    # k_scale sharpens the softmax and v_scale scales the output: the kernel must apply both
    # (a kernel ignoring them would still match an unscaled reference).
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache, tables = _fp8_paged([50, 3], 2, 16, 64, g, 1.0, 1.0)
    q = torch.randn(2, 8, 64, generator=g).bfloat16()
    lens = torch.tensor([50, 3], dtype=torch.int32)
    with emulated():
        plain = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
        scaled = pagedkern.paged_attention(
            q, k_cache, v_cache, tables, lens, k_scale=0.25, v_scale=4.0
        )
    ref = reference.paged_attention(q, k_cache, v_cache, tables, lens, k_scale=0.25, v_scale=4.0)
    assert float((scaled.double() - plain.double()).norm() / plain.double().norm()) > 0.5
    assert float((scaled.double() - ref.double()).norm() / ref.double().norm()) <= 1e-2


def test_fp8_cache_with_float32_activations_has_no_kernel():
    # Validation accepts it (the reference runs it on the CPU); the strict backend refuses it
    # with the support decision's reason instead of launching a kernel that does not exist.
    q = torch.randn(2, 4, 64)
    k_cache, v_cache, tables = _fp8_paged([5, 9], 2, 16, 64, torch.Generator(), 1.0, 1.0)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with (
        pytest.raises(KernelUnsupportedError, match="paged_attention: .*dtype float32"),
        emulated(expect_launch=False),
    ):
        pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
    k = torch.randn(3, 2, 64)
    with (
        pytest.raises(KernelUnsupportedError, match="rope_and_cache: .*fp8"),
        emulated(expect_launch=False),
    ):
        pagedkern.rope_and_cache(
            torch.randn(3, 4, 64), k, k.clone(), torch.zeros(3, dtype=torch.int32),
            cos_sin_cache(64, 4), k_cache, v_cache, torch.arange(3, dtype=torch.int32),
        )  # fmt: skip
