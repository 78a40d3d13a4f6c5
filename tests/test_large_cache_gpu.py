"""One KV cache larger than 2^31 elements, with the sequences' pages at its top (more than 4 GB
into it): decode, RoPE + cache write and both prefill paths must address pages past every int32
element offset. The sequences' pages also live in a small compact cache, on which the fp32
reference runs (an fp32 copy of the big one would need 16 GB). Skips where the GPU lacks the
~10 GB the two caches and the work take."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from kernel_check import assert_close_to, poisoned

import pagedkern
from pagedkern import reference
from pagedkern.reference import cos_sin_cache

# The module (the package re-exports the function under the same name).
fp_module = importlib.import_module("pagedkern.ops.flash_prefill")

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HKV, BLOCK, D, HQ = 8, 16, 128, 32
PAGE = HKV * BLOCK * D  # elements per page
TOP = 64  # the sequences' pages are drawn from the last TOP blocks
NUM_BLOCKS = (1 << 31) // PAGE + TOP  # 2^31 + 2^20 elements per cache
DTYPE = torch.bfloat16
NEED_BYTES = 2 * NUM_BLOCKS * PAGE * 2 + (2 << 30)  # K and V in bf16, plus 2 GiB of work


def make_caches(num_blocks: int, device: str):
    k_cache = torch.full((num_blocks, HKV, BLOCK, D), math.nan, dtype=DTYPE, device=device)
    return k_cache, torch.full_like(k_cache, math.nan)


@pytest.fixture(scope="module")
def big_cache():
    free, _ = torch.cuda.mem_get_info()
    if free < NEED_BYTES:
        pytest.skip(f"needs {NEED_BYTES / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f}")
    caches = make_caches(NUM_BLOCKS, DEVICE)
    assert caches[0].numel() > 2**31
    yield caches
    del caches
    torch.cuda.empty_cache()


def place(seq_lens, big, seed):
    """Random pages for the sequences in a compact cache and at the top of `big`, in shuffled
    order: (small k, small v, small tables, big tables)."""
    g = torch.Generator(device=big[0].device).manual_seed(seed)
    pages = [-(-n // BLOCK) for n in seq_lens]
    n = sum(pages)
    assert n <= TOP
    num_blocks = big[0].shape[0]
    top = num_blocks - 1 - torch.randperm(TOP, generator=g, device=big[0].device)[:n]
    assert int(top.min()) * PAGE >= 2**31 or num_blocks < NUM_BLOCKS  # past int32 offsets
    shape = (n, HKV, BLOCK, D)
    small = [torch.randn(shape, generator=g, device=big[0].device).to(DTYPE) for _ in range(2)]
    for cache, pages_of in zip(big, small, strict=True):
        cache[top.long()] = pages_of
    width = max(pages) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=big[0].device)
    start = 0
    for b, count in enumerate(pages):
        tables[b, :count] = torch.arange(start, start + count, dtype=torch.int32)
        start += count
    big_tables = top.int()[tables.long()]
    return small[0], small[1], tables, big_tables


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_reads_pages_past_2_31_elements(big_cache, num_splits):
    seq_lens = [1, 100, 333, 17]
    k_small, v_small, tables, big_tables = place(seq_lens, big_cache, seed=1)
    q = torch.randn(len(seq_lens), HQ, D, device=DEVICE).to(DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, DTYPE, DEVICE)
    pagedkern.paged_attention(q, *big_cache, big_tables, lens, out=out, num_splits=num_splits)
    ref = reference.paged_attention(q.float(), k_small.float(), v_small.float(), tables, lens)
    assert_close_to(out, ref, DTYPE)


@pytest.fixture(params=["sm80", "sm90"])
def path(request, monkeypatch):
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("path 2 needs an sm_90 GPU")
    monkeypatch.setenv(fp_module.PATH_ENV, request.param)
    return request.param


def test_prefill_reads_pages_past_2_31_elements(big_cache, path):
    pairs = [(100, 0), (37, 200), (1, 63), (130, 5)]  # (chunk, cached prefix)
    seq_lens = [c + p for c, p in pairs]
    k_small, v_small, tables, big_tables = place(seq_lens, big_cache, seed=2)
    total = sum(c for c, _ in pairs)
    q = torch.randn(total, HQ, D, device=DEVICE).to(DTYPE)
    cu = torch.tensor([0, 100, 137, 138, 268], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, DTYPE, DEVICE)
    pagedkern.flash_prefill(q, *big_cache, cu, big_tables, lens, out=out)
    ref = reference.flash_prefill(q.float(), k_small.float(), v_small.float(), cu, tables, lens)
    assert_close_to(out, ref, DTYPE)


def test_rope_writes_pages_past_2_31_elements(big_cache):
    tokens = 40
    k_small, v_small, tables, big_tables = place([tokens], big_cache, seed=3)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    q = torch.randn(tokens, HQ, D, generator=g, device=DEVICE).to(DTYPE)
    k = torch.randn(tokens, HKV, D, generator=g, device=DEVICE).to(DTYPE)
    v = torch.randn(tokens, HKV, D, generator=g, device=DEVICE).to(DTYPE)
    positions = torch.randint(0, 4096, (tokens,), generator=g, device=DEVICE, dtype=torch.int32)
    order = torch.randperm(tokens, generator=g, device=DEVICE)  # tokens land out of order
    small_slots = (tables[0].long()[order // BLOCK] * BLOCK + order % BLOCK).int()
    big_slots = (big_tables[0].long()[order // BLOCK] * BLOCK + order % BLOCK).int()
    small_slots[::5] = big_slots[::5] = -1  # skipped writes
    cos_sin = cos_sin_cache(D, 4096, device=DEVICE)
    expected = [t.clone() for t in (q, k, v, k_small, v_small)]
    reference.rope_and_cache(*expected[:3], positions, cos_sin, *expected[3:], small_slots)
    pagedkern.rope_and_cache(q, k, v, positions, cos_sin, *big_cache, big_slots)
    pages = big_tables[0, : k_small.shape[0]].long()
    for got, want in zip(
        (q, k, v, big_cache[0][pages], big_cache[1][pages]), expected, strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # bit-exact, as everywhere
