"""QK-norm fused into rope_and_cache (per-head RMSNorm of q and k, then RoPE, then the cache
write), run on the CPU through the emulator against the unfused reference (reference.rms_norm
of each head, then reference.rope_and_cache): odd head dims, views into a fused QKV output,
skipped slots, fp8 caches, NaN-poisoned caches. The kernel's sum of squares adds in another
order than torch's mean, so a normalised value may round one unit apart; nearly all are
bit-equal. Skipped where the emulator cannot build."""

from __future__ import annotations

import math

import pytest
import torch
from emulator import emulated, unavailable_reason

import pagedkern
from pagedkern import reference
from pagedkern.ops.support import KernelUnsupportedError
from pagedkern.reference import cos_sin_cache

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _case(dtype, d, hq, hkv, tokens, g, cache_dtype=None):
    qkv = (3 * torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)).to(dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    positions = torch.randint(0, 1024, (tokens,), generator=g, dtype=torch.int32)
    block_size = 8
    blocks = -(-tokens // block_size) + 1
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].int()
    slots[::3] = -1
    k_cache = torch.full((blocks, hkv, block_size, d), math.nan, dtype=dtype)
    if cache_dtype is not None:
        k_cache = k_cache.to(cache_dtype)
    v_cache = k_cache.clone()
    q_norm = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    k_norm = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    return q, k, v, positions, cos_sin_cache(d, 1024), k_cache, v_cache, slots, q_norm, k_norm


def _expected(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm, eps, **kw):
    q, k, v, k_cache, v_cache = (t.clone() for t in (q, k, v, k_cache, v_cache))
    q.copy_(reference.rms_norm(q, q_norm, eps))
    k.copy_(reference.rms_norm(k, k_norm, eps))
    reference.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots, **kw)
    return q, k, v, k_cache, v_cache


def _close(got, want, dtype):
    """Equal where both are NaN (never-written slots), a rounding unit of the head's scale apart
    at most (a rotation carries a unit of its inputs into smaller outputs), and, for 16-bit
    types (the norm's output rounded to them absorbs the different sum), bit-equal in at least
    97% of the elements."""
    assert torch.equal(got.isnan(), want.isnan())
    g, w = got.float().nan_to_num(), want.float().nan_to_num()
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}[dtype]
    bound = 2 * ulp * (w.abs() + w.abs().amax(-1, keepdim=True))
    assert ((g - w).abs() <= bound).all()
    if dtype != torch.float32:
        assert (g == w).float().mean() >= 0.97


@pytest.mark.parametrize(
    "dtype, d, hq, hkv",
    [
        (torch.bfloat16, 128, 8, 2),
        (torch.float16, 64, 6, 3),
        (torch.float32, 6, 4, 1),  # one pair per lane, most lanes idle
        (torch.bfloat16, 256, 5, 5),  # Gemma 3's head dim, 10 heads: a partial CTA of warps
        (torch.float16, 320, 4, 2),  # 160 pairs: five per lane
    ],
)
def test_qk_norm_matches_the_unfused_reference(dtype, d, hq, hkv):
    g = torch.Generator().manual_seed(d + hq)
    args = _case(dtype, d, hq, hkv, 13, g)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm = args
    want = _expected(*args, eps=1e-6)
    with emulated():
        pagedkern.rope_and_cache(
            q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm=q_norm, k_norm=k_norm,
            norm_eps=1e-6,
        )  # fmt: skip
    for got, expected in zip((q, k, v, k_cache, v_cache), want, strict=True):
        _close(got, expected, dtype)
    # the norm did something: without it the rotated heads differ
    plain = [t.clone() for t in args[:7]]
    reference.rope_and_cache(*plain[:5], plain[5], plain[6], slots)
    assert not torch.allclose(q.float(), plain[0].float(), atol=1e-2)


def test_qk_norm_with_an_fp8_cache():
    g = torch.Generator().manual_seed(3)
    args = _case(torch.bfloat16, 128, 4, 2, 9, g, cache_dtype=torch.float8_e4m3fn)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm = args
    want = _expected(*args, eps=1e-5, k_scale=0.5, v_scale=2.0)
    with emulated():
        pagedkern.rope_and_cache(
            q, k, v, positions, cos_sin, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0,
            q_norm=q_norm, k_norm=k_norm, norm_eps=1e-5,
        )  # fmt: skip
    _close(q, want[0], torch.bfloat16)
    _close(k, want[1], torch.bfloat16)
    written = slots >= 0
    pages, offsets = slots[written] // 8, slots[written] % 8
    for got, expected in ((k_cache, want[3]), (v_cache, want[4])):
        a = got[pages.long(), :, offsets.long()].float()
        b = expected[pages.long(), :, offsets.long()].float()
        assert not a.isnan().any()
        # one E4M3 step (3 mantissa bits) apart at most, where the fp32 inputs differed by a bit
        assert ((a - b).abs() <= b.abs() / 8 + 1e-3).all()
        assert (a == b).float().mean() >= 0.95


def test_qk_norm_arguments_are_checked():
    g = torch.Generator().manual_seed(4)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm = _case(
        torch.bfloat16, 64, 2, 1, 3, g
    )
    base = (q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="both or neither"):
        pagedkern.rope_and_cache(*base, q_norm=q_norm)
    with pytest.raises(ValueError, match="k_norm"):
        pagedkern.rope_and_cache(*base, q_norm=q_norm, k_norm=k_norm[:32])
    with pytest.raises(TypeError, match="q_norm"):
        pagedkern.rope_and_cache(*base, q_norm=q_norm.float(), k_norm=k_norm)
    with pytest.raises(ValueError, match="norm_eps"):
        pagedkern.rope_and_cache(*base, q_norm=q_norm, k_norm=k_norm, norm_eps=-1.0)


def test_qk_norm_beyond_the_kernels_head_dim_is_refused_under_the_strict_backend():
    g = torch.Generator().manual_seed(5)
    args = _case(torch.bfloat16, 576, 1, 1, 2, g)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm = args
    with (
        emulated(expect_launch=False),
        pytest.raises(KernelUnsupportedError, match="QK-norm over head_dim 576"),
    ):
        pagedkern.rope_and_cache(
            q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm=q_norm, k_norm=k_norm
        )
