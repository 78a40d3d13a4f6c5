"""The decode kernel's attention options (sliding window, logit soft-cap, attention sinks), both
variants, run on the CPU through the emulator (tests/emulator) against the reference: odd
shapes, windows of 1, inside a block, of a block, across blocks and longer than every sequence,
soft-caps on large logits, sinks (with a padding row), with and without split-KV. Every key
older than a sequence's window is NaN in the cache, so a kernel that read one into its math
would fail; outputs are NaN-poisoned beforehand. Skipped where the emulator cannot build."""

from __future__ import annotations

import math

import pytest
import torch
from emulator import emulated, unavailable_reason
from test_kernels_emulated import _paged

import pagedkern
from pagedkern import reference
from pagedkern.ops.paged_attention import decode_kernel, split_bounds
from pagedkern.ops.support import model_support

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

# (dtype, D, block size, Hq, Hkv, seq_lens, num_splits, window, soft_cap, sinks)
CASES = [
    (torch.bfloat16, 128, 16, 8, 2, [1, 15, 0, 16, 17, 100], None, 1, None, False),
    (torch.float16, 128, 16, 8, 2, [1, 15, 0, 16, 17, 100], 3, 5, None, False),
    (torch.bfloat16, 64, 32, 9, 3, [33, 64, 65, 255], None, 32, 2.0, False),
    (torch.float16, 64, 16, 4, 2, [300, 20, 129], 3, 70, None, True),
    (torch.bfloat16, 64, 16, 8, 1, [255, 1, 0], 2, None, 5.0, True),
    (torch.float16, 256, 32, 4, 4, [37, 300], 3, 1000, 30.0, False),
    (torch.bfloat16, 128, 64, 12, 1, [70, 3, 200], None, 33, None, True),
    (torch.float16, 64, 16, 7, 1, [255, 1, 64], 4, 100, 1.0, True),
]


def _poison_outside_window(k_cache, v_cache, tables, seq_lens, window):
    """NaN in every key and value a window hides (so reading one would poison the output)."""
    if window is None:
        return
    block_size = k_cache.shape[2]
    for b, n in enumerate(seq_lens):
        for t in range(max(0, n - window)):
            page = int(tables[b, t // block_size])
            k_cache[page, :, t % block_size] = math.nan
            v_cache[page, :, t % block_size] = math.nan


@pytest.mark.parametrize("variant", ["simt", "mma"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_options_match_the_reference(case, variant, kernels):
    dtype, d, block_size, hq, hkv, seq_lens, num_splits, window, cap, with_sinks = CASES[case]
    kernels(paged_attention=variant)
    g = torch.Generator().manual_seed(100 + case)
    k_cache, v_cache, tables = _paged(seq_lens, hkv, block_size, d, dtype, g)
    _poison_outside_window(k_cache, v_cache, tables, seq_lens, window)
    batch = len(seq_lens)
    scale = 4 * d**-0.5  # large logits: the cap bites
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    sinks = 2 * torch.randn(hq, generator=g) if with_sinks else None
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    options = dict(sliding_window=window, soft_cap=cap, sinks=sinks)
    out = torch.full((batch, hq, d), math.nan, dtype=dtype)
    with emulated():
        result, lse = pagedkern.paged_attention(
            q, k_cache, v_cache, tables, lens, scale, out=out, return_lse=True,
            num_splits=num_splits, **options,
        )  # fmt: skip
    assert result is out
    ref, ref_lse = reference.paged_attention(
        q.double(), k_cache.double(), v_cache.double(), tables, lens, scale, return_lse=True,
        **options,
    )  # fmt: skip
    assert not out.isnan().any() and not ref.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3), err
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-4, atol=1e-4)
    for b, n in enumerate(seq_lens):
        if n == 0:  # padding row: zeros and lse -inf, sinks or not
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            assert torch.isneginf(lse[b]).all()


def test_options_change_the_kernel_output():
    # Each option measurably moves the result (the comparisons above could not pass by luck).
    dtype, d, block_size, hq, hkv, seq_lens = torch.bfloat16, 64, 16, 4, 2, [90, 40]
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache, tables = _paged(seq_lens, hkv, block_size, d, dtype, g)
    q = torch.randn(2, hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    runs = {}
    for name, option in [
        ("plain", {}),
        ("window", dict(sliding_window=20)),
        ("cap", dict(soft_cap=1.0)),
        ("sinks", dict(sinks=torch.full((hq,), 3.0))),
    ]:
        with emulated():
            runs[name] = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, 0.5, **option)
    for name in ("window", "cap", "sinks"):
        assert (runs[name].float() - runs["plain"].float()).abs().max() > 1e-2, name


def test_a_window_shortens_the_split_plan_and_starts_splits_at_the_window():
    from pagedkern.ops.paged_attention import SplitPlan, plan_length

    assert plan_length(32768, 4096) == 4096 and plan_length(1000, None) == 1000
    plan = SplitPlan(3, 128)
    assert split_bounds(plan, 1000, window=300) == [(700, 828), (828, 956), (956, 1000)]
    assert split_bounds(plan, 200, window=300) == [(0, 128), (128, 200)]
    assert split_bounds(SplitPlan(1, 0), 50, window=7) == [(43, 50)]


def test_the_support_table_sends_windowed_decode_to_the_kernel():
    table = model_support(
        "bfloat16", 128, 16, 1000, attention={"sliding_window": 8, "soft_cap": 50.0}
    )
    assert table["paged_attention"].supported
    assert decode_kernel(4, 128) in ("simt", "mma")


@pytest.mark.parametrize("variant", ["simt", "mma"])
def test_paged_attention_options_over_an_fp8_cache(variant, kernels):
    # E4M3 pages (k_scale, v_scale folded in) with every option: the options do not care how
    # a page is stored; keys outside the window are NaN pages there too.
    from pagedkern.reference.rope import quantize_e4m3

    kernels(paged_attention=variant)
    dtype, d, block_size, hq, hkv, seq_lens, window = torch.bfloat16, 128, 16, 8, 2, [90, 0, 33], 40
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables = _paged(seq_lens, hkv, block_size, d, torch.float32, g)
    _poison_outside_window(k_cache, v_cache, tables, seq_lens, window)
    k8, v8 = quantize_e4m3(k_cache, 0.02), quantize_e4m3(v_cache, 0.03)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    options = dict(sliding_window=window, soft_cap=4.0, sinks=torch.randn(hq, generator=g))
    out = torch.full(q.shape, math.nan, dtype=dtype)
    with emulated():
        pagedkern.paged_attention(
            q, k8, v8, tables, lens, out=out, num_splits=2, k_scale=0.02, v_scale=0.03, **options
        )
    ref = reference.paged_attention(
        q.double(), k8, v8, tables, lens, k_scale=0.02, v_scale=0.03, **options
    )
    assert not out.isnan().any()
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-2
