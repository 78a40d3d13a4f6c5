"""rope_and_cache kernel vs the reference on the GPU: random positions and slot mappings with -1
(skipped) entries, q/k/v as views into a fused QKV output or separate tensors, every float dtype,
head dims with the 16-byte path and without it (odd sizes, misaligned views). The kernel computes
the reference's fp32 expressions without FMA contraction, so results are bit-identical; cache slots
that must not be written keep their NaN poison."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_check import every_variant

import pagedkern
from pagedkern import reference
from pagedkern.reference import cos_sin_cache

pytestmark = pytest.mark.gpu
kernel_variant = every_variant("rope_and_cache")  # every test on every variant of the kernel

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (tokens, Hq, Hkv, D, block size): decode and prefill sizes, GQA and MHA, odd head dims.
SHAPES = [
    (1, 32, 8, 128, 16),
    (64, 32, 8, 128, 16),
    (7, 9, 3, 64, 32),
    (300, 16, 2, 256, 64),
    (4096, 32, 8, 128, 16),
    (33, 4, 1, 6, 16),  # D/2 = 3: element by element
    (5, 2, 2, 40, 8),  # D/2 = 20: not a multiple of the vector width
]


def make(tokens, hq, hkv, d, block_size, dtype, fused, seed, offset=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if fused:  # views into one [T, (Hq + 2 Hkv) D] buffer, as the QKV GEMM writes it
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d + offset, generator=g, device=DEVICE).to(dtype)
        q = qkv[:, offset : offset + hq * d].view(tokens, hq, d)
        k = qkv[:, offset + hq * d : offset + (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, offset + (hq + hkv) * d :].view(tokens, hkv, d)
    else:
        q = torch.randn(tokens, hq, d, generator=g, device=DEVICE).to(dtype)
        k = torch.randn(tokens, hkv, d, generator=g, device=DEVICE).to(dtype)
        v = torch.randn(tokens, hkv, d, generator=g, device=DEVICE).to(dtype)
    num_blocks = tokens // block_size + 3
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, generator=g, device=DEVICE)[:tokens].int()
    slots[torch.rand(tokens, generator=g, device=DEVICE) < 0.2] = -1
    k_cache = torch.full((num_blocks, hkv, block_size, d), math.nan, dtype=dtype, device=DEVICE)
    return q, k, v, positions, slots, k_cache, k_cache.clone()


def run_and_compare(q, k, v, positions, slots, k_cache, v_cache, cos_sin):
    expected = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    reference.rope_and_cache(*expected[:3], positions, cos_sin, *expected[3:], slots)
    pagedkern.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    for got, want in zip((q, k, v, k_cache, v_cache), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hq, hkv, d, block_size", SHAPES)
def test_matches_reference_bit_for_bit(tokens, hq, hkv, d, block_size, dtype, fused):
    q, k, v, positions, slots, k_cache, v_cache = make(
        tokens, hq, hkv, d, block_size, dtype, fused, seed=tokens * d
    )
    cos_sin = cos_sin_cache(d, 8192, base=500000.0, device=DEVICE)
    run_and_compare(q, k, v, positions, slots, k_cache, v_cache, cos_sin)
    written = int((slots >= 0).sum())
    assert int((~k_cache.isnan()).all(-1).sum()) == written * hkv, "only the mapped slots"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_views_take_the_scalar_path(dtype):
    # A 2-byte (or 4-byte) offset breaks 16-byte alignment of every row.
    q, k, v, positions, slots, k_cache, v_cache = make(
        19, 8, 2, 128, 16, dtype, fused=True, seed=3, offset=1
    )
    run_and_compare(
        q, k, v, positions, slots, k_cache, v_cache, cos_sin_cache(128, 8192, device=DEVICE)
    )


def test_scaled_frequencies_come_from_the_table():
    # Llama 3 style: arbitrary inv_freq reach the kernel through cos_sin only.
    inv_freq = torch.rand(64, dtype=torch.float64) * 0.5
    cos_sin = cos_sin_cache(128, 8192, inv_freq=inv_freq, device=DEVICE)
    q, k, v, positions, slots, k_cache, v_cache = make(50, 8, 8, 128, 16, torch.bfloat16, True, 4)
    run_and_compare(q, k, v, positions, slots, k_cache, v_cache, cos_sin)


def test_all_slots_skipped_and_zero_tokens():
    q, k, v, positions, slots, k_cache, v_cache = make(9, 4, 2, 64, 16, torch.float16, True, 5)
    slots.fill_(-1)
    run_and_compare(
        q, k, v, positions, slots, k_cache, v_cache, cos_sin_cache(64, 8192, device=DEVICE)
    )
    assert k_cache.isnan().all() and v_cache.isnan().all()
    empty = [t[:0] for t in (q, k, v, positions, slots)]
    pagedkern.rope_and_cache(
        *empty[:4], cos_sin_cache(64, 16, device=DEVICE), k_cache, v_cache, empty[4]
    )


def test_runs_on_the_callers_stream():
    q, k, v, positions, slots, k_cache, v_cache = make(256, 32, 8, 128, 16, torch.bfloat16, True, 6)
    cos_sin = cos_sin_cache(128, 8192, device=DEVICE)
    new_positions = (positions + 17) % 8192
    expected = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    reference.rope_and_cache(*expected[:3], new_positions, cos_sin, *expected[3:], slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        positions.copy_(new_positions)
        pagedkern.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    stream.synchronize()
    torch.testing.assert_close(q, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(k_cache, expected[3], rtol=0, atol=0, equal_nan=True)
