"""The reference cos_sin_cache and rope_and_cache against plain float64 math.

RoPE (rotate-half) pairs element i with element i + D/2; as a complex number x1 + i*x2 the pair is
multiplied by exp(i * p * f_i). The expected values below use that complex formulation with angles
in float64, independent of the reference's table and rotation helpers.
"""

from __future__ import annotations

import pytest
import torch

from pagedkern.reference import cos_sin_cache, rope_and_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POISON = float("nan")  # cache slots that must not be written keep this


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _inv_freq64(head_dim: int, base: float) -> torch.Tensor:
    exponents = [-2.0 * i / head_dim for i in range(head_dim // 2)]
    return torch.tensor([base**e for e in exponents], dtype=torch.float64)


def _rotate64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any dtype) rotated in float64 via complex multiplication."""
    half = x.shape[-1] // 2
    x64 = x.double()
    z = torch.complex(x64[..., :half], x64[..., half:])
    angle = positions.double()[:, None, None] * inv_freq[None, None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def _assert_rounded_close(actual, exact, dtype):
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    # fp32 math on a float32 table: a few 1e-7 relative; fp16/bf16: one rounding (half an ulp).
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    torch.testing.assert_close(actual.double(), exact, rtol=rtol * 1.01, atol=2e-6)


@pytest.mark.parametrize("head_dim", [2, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_cos_sin_cache_matches_float64(head_dim, base):
    max_pos = 4096
    table = cos_sin_cache(head_dim, max_pos, base=base)
    assert table.shape == (max_pos, head_dim) and table.dtype == torch.float32
    angle = torch.arange(max_pos, dtype=torch.float64)[:, None] * _inv_freq64(head_dim, base)
    # Angles up to 4096 rad: an fp32 angle would be off by ~2e-4; the table must be better.
    torch.testing.assert_close(table[:, : head_dim // 2].double(), angle.cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(table[:, head_dim // 2 :].double(), angle.sin(), rtol=0, atol=1e-7)


def test_cos_sin_cache_custom_inv_freq():
    # Arbitrary (e.g. Llama 3 scaled) frequencies reach the table unchanged.
    g = torch.Generator().manual_seed(0)
    inv_freq = torch.rand(32, generator=g, dtype=torch.float64) * 0.9 + 0.01
    table = cos_sin_cache(64, 300, inv_freq=inv_freq.float())
    angle = torch.arange(300, dtype=torch.float64)[:, None] * inv_freq.float().double()
    torch.testing.assert_close(
        table.double(), torch.cat([angle.cos(), angle.sin()], -1), atol=1e-7, rtol=0
    )


def test_cos_sin_cache_rejects_odd_head_dim():
    with pytest.raises(ValueError):
        cos_sin_cache(63, 16)


def _table(head_dim: int, max_pos: int, base: float = 10000.0) -> torch.Tensor:
    """Our own float32 [cos | sin] table, built without the reference."""
    angle = torch.arange(max_pos, dtype=torch.float64)[:, None] * _inv_freq64(head_dim, base)
    return torch.cat([angle.cos(), angle.sin()], dim=-1).float()


def _setup(num_tokens, hq, hkv, d, num_blocks, block_size, dtype, seed, fused_qkv):
    """q, k, v ([T, H, D] views), positions, slot_mapping (distinct slots, some -1), caches."""
    g = torch.Generator().manual_seed(seed)
    if fused_qkv:
        # One [T, (Hq + 2 Hkv) * D] GEMM output; q, k, v are strided views into it.
        qkv = _randn((num_tokens, (hq + 2 * hkv) * d), dtype, seed)
        q = qkv[:, : hq * d].view(num_tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
        assert not k.is_contiguous() and not v.is_contiguous()
    else:
        qkv = None
        q = _randn((num_tokens, hq, d), dtype, seed)
        k = _randn((num_tokens, hkv, d), dtype, seed + 1)
        v = _randn((num_tokens, hkv, d), dtype, seed + 2)
    positions = torch.randint(0, 2048, (num_tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1  # padding tokens: not written
    slots[0] = -1
    cache_shape = (num_blocks, hkv, block_size, d)
    k_cache = torch.full(cache_shape, POISON, dtype=dtype)
    v_cache = torch.full(cache_shape, POISON, dtype=dtype)
    return qkv, q, k, v, positions, slots, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 64), (8, 2, 128), (3, 1, 8)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_rope_and_cache(dtype, hq, hkv, d, block_size, fused_qkv):
    num_tokens, num_blocks = 37, 5
    qkv, q, k, v, positions, slots, k_cache, v_cache = _setup(
        num_tokens,
        hq,
        hkv,
        d,
        num_blocks,
        block_size,
        dtype,
        seed=hq * d + block_size,
        fused_qkv=fused_qkv,
    )
    if fused_qkv:  # the engine's int32 metadata (int64 in the other half of the cases)
        positions, slots = positions.int(), slots.int()
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    inv_freq = _inv_freq64(d, 10000.0)
    q_expect, k_expect = _rotate64(q, positions, inv_freq), _rotate64(k, positions, inv_freq)
    v_before = v.clone()
    qkv_before = qkv.clone() if fused_qkv else None

    rope_and_cache(q, k, v, positions, _table(d, 2048), k_cache, v_cache, slots)

    # q and k rotated in place (for fused_qkv, inside the shared buffer); v untouched.
    assert q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    _assert_rounded_close(q, q_expect, dtype)
    _assert_rounded_close(k, k_expect, dtype)
    assert torch.equal(v, v_before)
    if fused_qkv:  # nothing outside the q and k columns of the fused buffer moved
        assert torch.equal(qkv[:, (hq + hkv) * d :], qkv_before[:, (hq + hkv) * d :])

    # Each kept token's rotated k and its v sit at (slot // block_size, :, slot % block_size).
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, :, offset], k[t]), f"k of token {t}"
        assert torch.equal(v_cache[block, :, offset], v[t]), f"v of token {t}"
        written[block, offset] = True
    assert written.any() and not written.all()
    # Every other slot (including the ones -1 tokens would have hit) keeps its poison.
    untouched = ~written[:, None, :, None].expand_as(k_cache)
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


def test_rope_position_zero_is_identity_and_norm_preserved():
    # Position 0 leaves q and k unchanged; any rotation preserves each pair's length.
    q = _randn((6, 2, 16), torch.float32, 1)
    k = _randn((6, 1, 16), torch.float32, 2)
    v = _randn((6, 1, 16), torch.float32, 3)
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([0, 0, 5, 100, 1000, 2047])
    cache = torch.full((2, 1, 16, 16), POISON)
    no_slots = torch.full((6,), -1, dtype=torch.int32)
    rope_and_cache(q, k, v, positions, _table(16, 2048), cache, cache.clone(), no_slots)
    assert torch.equal(q[:2], q0[:2]) and torch.equal(k[:2], k0[:2])
    assert not torch.allclose(q[2:], q0[2:])

    def pair_norm(x):
        return torch.hypot(x[..., :8].double(), x[..., 8:].double())

    torch.testing.assert_close(pair_norm(q), pair_norm(q0), rtol=1e-6, atol=1e-6)
    assert cache.isnan().all(), "slot -1 everywhere: nothing written"


def test_rope_uses_the_given_table():
    # A table with custom (e.g. scaled) frequencies drives the rotation, not a built-in base.
    d, max_pos = 32, 512
    g = torch.Generator().manual_seed(7)
    inv_freq = (torch.rand(d // 2, generator=g, dtype=torch.float64) * 0.5).float().double()
    angle = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq
    table = torch.cat([angle.cos(), angle.sin()], dim=-1).float()
    q, k, v = (_randn((9, 2, d), torch.float32, s) for s in (10, 11, 12))
    positions = torch.randint(0, max_pos, (9,), generator=g)
    q_expect, k_expect = _rotate64(q, positions, inv_freq), _rotate64(k, positions, inv_freq)
    cache = torch.full((1, 2, 16, d), POISON)
    rope_and_cache(q, k, v, positions, table, cache, cache.clone(), torch.arange(9))
    _assert_rounded_close(q, q_expect, torch.float32)
    _assert_rounded_close(k, k_expect, torch.float32)
    assert torch.equal(cache[0, :, :9].transpose(0, 1), k)
