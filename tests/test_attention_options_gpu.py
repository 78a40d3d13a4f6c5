"""The attention options (sliding window, soft-cap, sinks) and the fused QK-norm in the CUDA
kernels on a GPU, against the reference: paged_attention (both variants, split-KV on and off),
flash_prefill (path 1, where every call with an option runs, and path 2's options kernel on
Hopper under the sm90_options variant: chunks, prefixes, windows smaller and larger than a
tile, head dims 64, 128 and 256), rope_and_cache with q_norm / k_norm. Keys a
window hides are NaN in the cache (a windowed model's released pages hold anything), outputs
are poisoned beforehand.
Skipped without a GPU (pytest.mark.gpu)."""

from __future__ import annotations

import math

import pytest
import torch
from test_attention_options_emulated import _poison_outside_window
from test_kernels_emulated import _paged
from test_rope_qk_norm_emulated import _case, _close, _expected

import pagedkern
from pagedkern import reference

pytestmark = pytest.mark.gpu

DECODE = [  # (D, block size, Hq, Hkv, seq_lens, num_splits, window, soft_cap, sinks)
    (128, 16, 32, 8, [1, 4000, 0, 777, 4096], None, 1024, None, False),
    (128, 16, 32, 8, [1, 4000, 0, 777, 4096], 8, 100, 30.0, True),
    (64, 32, 8, 8, [33, 3000, 2049], 4, 5, 50.0, False),
    (256, 16, 8, 4, [513, 9, 1500], None, 300, None, True),
]


@pytest.mark.parametrize("variant", ["simt", "mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(DECODE)))
def test_paged_attention_options_on_the_gpu(case, dtype, variant, kernels):
    d, block_size, hq, hkv, seq_lens, num_splits, window, cap, with_sinks = DECODE[case]
    kernels(paged_attention=variant)
    g = torch.Generator().manual_seed(case)
    k_cache, v_cache, tables = _paged(seq_lens, hkv, block_size, d, dtype, g)
    _poison_outside_window(k_cache, v_cache, tables, seq_lens, window)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    sinks = 2 * torch.randn(hq, generator=g) if with_sinks else None
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    options = dict(sliding_window=window, soft_cap=cap, sinks=sinks)
    want, want_lse = reference.paged_attention(
        q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.3, return_lse=True,
        **options,
    )  # fmt: skip
    out = torch.full(q.shape, math.nan, dtype=dtype, device="cuda")
    got, lse = pagedkern.paged_attention(
        q.cuda(), k_cache.cuda(), v_cache.cuda(), tables.cuda(), lens.cuda(), 0.3, out=out,
        return_lse=True, num_splits=num_splits, sliding_window=window, soft_cap=cap,
        sinks=None if sinks is None else sinks.cuda(),
    )  # fmt: skip
    assert not got.isnan().any()
    err = float((got.cpu().double() - want).norm() / want.norm())
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3), err
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-3, atol=1e-3)


PREFILL = [  # (D, block size, Hq, Hkv, (chunk, prefix) pairs, window, soft_cap, sinks)
    (128, 16, 8, 2, [(1, 0), (300, 0), (113, 1000), (7, 15)], 100, None, False),
    (64, 16, 12, 4, [(1023, 0), (64, 64), (5, 3)], 1, 20.0, True),
    (128, 32, 4, 4, [(200, 300), (129, 0)], 1000, 50.0, True),
    (64, 16, 8, 1, [(513, 16)], 70, None, True),
    # D = 256 (Gemma 3: window and QK-norm; 64-row work items, an empty second half under 65)
    (256, 16, 8, 2, [(1, 0), (65, 0), (300, 40), (129, 1000), (64, 7)], 60, None, True),
    (256, 32, 4, 1, [(513, 16), (3, 0)], 1024, 30.0, False),
]


@pytest.mark.parametrize("variant", ["v2", "sm90_options"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(PREFILL)))
def test_flash_prefill_options_on_the_gpu(case, dtype, variant, kernels):
    # sm90_options: path 2's options kernel on Hopper (D 64 / 128; D = 256 stays on path 1)
    if variant == "sm90_options" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("path 2 needs an sm_90 GPU")
    kernels(flash_prefill=variant)
    d, block_size, hq, hkv, pairs, window, cap, with_sinks = PREFILL[case]
    g = torch.Generator().manual_seed(50 + case)
    lengths = [c + p for c, p in pairs]
    k_cache, v_cache, tables = _paged(lengths, hkv, block_size, d, dtype, g)
    for b, (_, p) in enumerate(pairs):  # keys before the first query's window: NaN
        for t in range(max(0, p - window + 1)):
            page = int(tables[b, t // block_size])
            k_cache[page, :, t % block_size] = math.nan
            v_cache[page, :, t % block_size] = math.nan
    total = sum(c for c, _ in pairs)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    cu = torch.tensor(
        [0, *torch.tensor([c for c, _ in pairs]).cumsum(0).tolist()], dtype=torch.int32
    )
    lens = torch.tensor(lengths, dtype=torch.int32)
    sinks = 2 * torch.randn(hq, generator=g) if with_sinks else None
    options = dict(sliding_window=window, soft_cap=cap)
    want = reference.flash_prefill(
        q.double(), k_cache.double(), v_cache.double(), cu, tables, lens, **options, sinks=sinks
    )
    out = torch.full(q.shape, math.nan, dtype=dtype, device="cuda")
    got = pagedkern.flash_prefill(
        q.cuda(), k_cache.cuda(), v_cache.cuda(), cu.cuda(), tables.cuda(), lens.cuda(), out=out,
        **options, sinks=None if sinks is None else sinks.cuda(),
    )  # fmt: skip
    assert not got.isnan().any()
    err = float((got.cpu().double() - want).norm() / want.norm())
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3), err


@pytest.mark.parametrize(
    "dtype, d", [(torch.bfloat16, 128), (torch.float16, 256), (torch.float32, 64)]
)
def test_rope_qk_norm_on_the_gpu(dtype, d):
    g = torch.Generator().manual_seed(d)
    args = _case(dtype, d, 16, 4, 300, g)
    want = _expected(*args, eps=1e-6)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm = (a.cuda() for a in args)
    pagedkern.rope_and_cache(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm=q_norm, k_norm=k_norm
    )
    for got, expected in zip((q, k, v, k_cache, v_cache), want, strict=True):
        _close(got.cpu(), expected, dtype)
