"""flash_prefill kernels vs the reference on the GPU, with FlashAttention's rule: the kernel's
error against an fp32 reference is at most twice that of the same attention computed by PyTorch
in the input dtype, plus the dtype's rounding at the output's magnitude.

One varlen batch holds every (chunk, prefix) pair of chunk lengths {1, 7, 113, 1023, 4096} and
cached prefixes {0, 15, 16, 1000} (fresh prompts, chunked prefill, prefix-cache hits; one long
sequence among short ones), swept over GQA ratios {1, 3, 4, 8}, head dims {64, 128}, both dtypes
and both kernel paths (path 2 on Hopper only; PAGEDKERN_FLASH_PREFILL_PATH forces a path); head
dim 256 (path 1 only) in a test of its own. The
cache outside the sequences' keys is NaN and the block tables' unused entries point at a NaN
page, so any read past seq_len or past the table shows up; outputs are poisoned before the call.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from kernel_check import every_variant, poisoned

import pagedkern
from pagedkern import reference
from pagedkern.reference.key_blocks import gather_sequence

# The module (pagedkern.ops.flash_prefill, attribute access gives the function of that name).
fp_module = importlib.import_module("pagedkern.ops.flash_prefill")

pytestmark = pytest.mark.gpu
# every test on every variant of the kernel (sm90_options: v2 for calls without options)
kernel_variant = every_variant("flash_prefill", skip=("sm90_options",))

CHUNKS = (1, 7, 113, 1023, 4096)
PREFIXES = (0, 15, 16, 1000)
GQA_RATIOS = (1, 3, 4, 8)
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
NUM_KV_HEADS = 2
DEVICE = "cuda"  # the helpers below also run on "cpu" (a dry run of this file's own logic)


def hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["sm80", "sm90"])
def path(request, monkeypatch):
    if request.param == "sm90" and not hopper():
        pytest.skip("path 2 needs an sm_90 GPU")
    monkeypatch.setenv(fp_module.PATH_ENV, request.param)
    return request.param


def make_batch(pairs, num_heads, head_dim, dtype, block_size, seed, q_pad=64):
    """q (a strided view, as from a fused QKV projection), caches whose slots outside the
    sequences hold NaN, shuffled block tables padded with a NaN page, cu_seqlens, seq_lens."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    chunks = [c for c, _ in pairs]
    seq_lens = [c + p for c, p in pairs]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 1  # the last block is the NaN trap page
    shape = (num_blocks, NUM_KV_HEADS, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks - 1, generator=g, device=DEVICE).int()
    table = torch.full((len(pairs), max(pages) + 2), num_blocks - 1, dtype=torch.int32)
    start = 0
    for b, (n_pages, seq_len) in enumerate(zip(pages, seq_lens, strict=True)):
        blocks = perm[start : start + n_pages]
        start += n_pages
        table[b, :n_pages] = blocks.cpu()
        for cache in (k_cache, v_cache):
            keys = torch.full((NUM_KV_HEADS, n_pages * block_size, head_dim), float("nan"))
            keys = keys.to(DEVICE)
            keys[:, :seq_len] = torch.randn(
                NUM_KV_HEADS, seq_len, head_dim, generator=g, device=DEVICE
            )
            pages_of_seq = keys.view(NUM_KV_HEADS, n_pages, block_size, head_dim).transpose(0, 1)
            cache[blocks.long()] = pages_of_seq.to(dtype)
    total = sum(chunks)
    qkv = torch.randn(total, num_heads * head_dim + q_pad, generator=g, device=DEVICE).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(total, num_heads, head_dim)
    cu = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, cu, table.to(DEVICE), seq


def attention_in_dtype(q, k_cache, v_cache, cu, table, seq_lens, scale):
    """The same attention with every op in q's dtype (FlashAttention's "PyTorch" baseline)."""
    out = torch.zeros_like(q)
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[1]
    bounds, lengths = cu.tolist(), seq_lens.tolist()
    for b, length in enumerate(lengths):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        k = gather_sequence(k_cache, table[b], length).to(q.dtype)
        v = gather_sequence(v_cache, table[b], length).to(q.dtype)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, L, D]
        scores = torch.einsum("thd,hld->htl", q[s:e] * scale, k)
        pos = torch.arange(length - (e - s), length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[s:e] = torch.einsum("htl,hld->thd", torch.softmax(scores, dim=-1), v)
    assert out.shape[1] == num_heads
    return out


_references: dict = {}


def references(key, q, k_cache, v_cache, cu, table, seq_lens, scale):
    """(fp32 out, fp32 lse, in-dtype out), once per batch (shared by both paths and the
    kernel variants), computed again when q is not the one they were computed for (a test that
    writes q: a stale reference once failed flash_prefill v1, run after v2 with another q)."""
    cached = _references.get(key)
    if cached is None or not torch.equal(cached[0], q):
        out32, lse32 = reference.flash_prefill(
            q.float(), k_cache.float(), v_cache.float(), cu, table, seq_lens, scale,
            return_lse=True,
        )  # fmt: skip
        low = attention_in_dtype(q, k_cache, v_cache, cu, table, seq_lens, scale)
        _references[key] = (q.clone(), (out32, lse32, low))
    return _references[key][1]


def assert_flash_rule(out, out32, low):
    """FlashAttention's forward check: max error <= 2 x the in-dtype error + rounding."""
    assert not torch.isnan(out).any(), "output holds NaN (poison survived or a bad read)"
    ref_lp = out32.to(out.dtype)
    rounding = 2 * ((ref_lp + 0.3 - 0.3) - ref_lp).abs().max().item()
    err = (out.float() - out32).abs().max().item()
    err_pt = (low.float() - out32).abs().max().item()
    assert err <= 2 * err_pt + rounding, f"max error {err:.3g} > 2 x {err_pt:.3g} + {rounding:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_matches_reference(path, ratio, head_dim, dtype):
    pairs = list(itertools.product(CHUNKS, PREFIXES))
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1)).tolist()
    pairs = [pairs[i] for i in order]
    num_heads = NUM_KV_HEADS * ratio
    batch = make_batch(pairs, num_heads, head_dim, dtype, 16, seed=ratio * head_dim)
    q = batch[0]
    scale = head_dim**-0.5
    key = (ratio, head_dim, dtype)
    out32, lse32, low = references(key, *batch, scale)
    out = poisoned(q.shape, dtype, DEVICE)
    _, lse = pagedkern.flash_prefill(*batch, out=out, return_lse=True)
    assert_flash_rule(out, out32, low)
    torch.testing.assert_close(lse, lse32, atol=2e-3, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256, 24])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_block_sizes(path, block_size, head_dim):
    """Block sizes 16/32/64 take TMA in path 2; 8 too (one swizzle atom); 128 and 256 too, where
    a 128-key tile is one page or half of one, so a TMA box starts mid-page (256); 24 falls back
    to path 1 (pages straddle 128-key tiles), which gathers any block size."""
    pairs = [(1, 0), (7, 40), (200, 0), (130, 333), (64, 64), (1000, 17)]
    dtype = torch.bfloat16
    batch = make_batch(pairs, 3 * NUM_KV_HEADS, head_dim, dtype, block_size, seed=block_size)
    taken_auto = hopper() and block_size != 24
    if path == "sm90" and not taken_auto:
        with pytest.raises(ValueError, match="block size"):
            pagedkern.flash_prefill(*batch)
        return
    out32, _, low = references(("bs", block_size, head_dim), *batch, head_dim**-0.5)
    assert_flash_rule(pagedkern.flash_prefill(*batch), out32, low)
    taken = fp_module.kernel_path(batch[0].device.index, head_dim, block_size, "auto")
    assert taken == ("sm90" if taken_auto else "sm80")


@pytest.mark.parametrize(
    "pairs",
    [[(1, 0)], [(1, 300)], [(5, 0), (1, 17), (40, 90)], [(127, 0)], [(63, 1000), (64, 0)]],
    ids=["1row", "1row-prefix", "46rows", "127rows", "127rows-2seq"],
)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fewer_query_rows_than_one_tile(path, pairs, head_dim):
    """Under 128 query rows in the whole batch: one partial M tile per sequence, the TMA load of
    q clipped at total_q, no full tile anywhere."""
    assert sum(c for c, _ in pairs) < 128
    batch = make_batch(pairs, 4 * NUM_KV_HEADS, head_dim, torch.float16, 16, seed=len(pairs))
    out = poisoned(batch[0].shape, torch.float16, DEVICE)
    _, lse = pagedkern.flash_prefill(*batch, out=out, return_lse=True)
    out32, lse32, low = references(("few", tuple(pairs), head_dim), *batch, head_dim**-0.5)
    assert_flash_rule(out, out32, low)
    torch.testing.assert_close(lse, lse32, atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", (1, 4))
def test_head_dim_256_on_path_1(ratio, dtype, monkeypatch):
    """D = 256 (Gemma 3) runs path 1 on every GPU, each 128-row tile as two 64-row work items:
    chunks of 1, 64, 65, 127, 128 and 129 rows (empty and partial second halves), prefixes,
    GQA; forcing path 2 is a clear error."""
    pairs = [(1, 0), (7, 15), (64, 0), (65, 16), (113, 1000), (127, 0), (128, 3), (129, 0)]
    pairs += [(1023, 16), (2000, 0)]
    batch = make_batch(pairs, NUM_KV_HEADS * ratio, 256, dtype, 16, seed=ratio)
    device = batch[0].device.index
    assert fp_module.kernel_path(device, 256, 16, "auto") == "sm80"
    out32, lse32, low = references(("d256", ratio, dtype), *batch, 256**-0.5)
    out = poisoned(batch[0].shape, dtype, DEVICE)
    _, lse = pagedkern.flash_prefill(*batch, out=out, return_lse=True)
    assert_flash_rule(out, out32, low)
    torch.testing.assert_close(lse, lse32, atol=2e-3, rtol=0)
    if hopper():
        monkeypatch.setenv(fp_module.PATH_ENV, "sm90")
        with pytest.raises(ValueError, match="head_dim"):
            pagedkern.flash_prefill(*batch)


def test_forced_paths_and_selection(monkeypatch):
    device = torch.cuda.current_device()
    assert fp_module.kernel_path(device, 128, 16, "sm80") == "sm80"
    assert fp_module.kernel_path(device, 128, 16, "auto") == ("sm90" if hopper() else "sm80")
    if not hopper():
        batch = make_batch([(5, 3)], 2, 64, torch.float16, 16, seed=0)
        monkeypatch.setenv(fp_module.PATH_ENV, "sm90")
        with pytest.raises(ValueError, match="sm_90"):
            pagedkern.flash_prefill(*batch)
    monkeypatch.setenv(fp_module.PATH_ENV, "fast")
    with pytest.raises(ValueError, match=fp_module.PATH_ENV):
        fp_module.requested_path()


def test_deterministic_empty_and_zero_length_chunks(path):
    pairs = [(300, 5), (0, 9), (1, 0), (0, 0), (2000, 100), (17, 17)]
    batch = make_batch(pairs, 8, 128, torch.bfloat16, 16, seed=3)
    first = pagedkern.flash_prefill(*batch)
    second = pagedkern.flash_prefill(*batch)
    assert torch.equal(first, second)  # each tile is computed alone: no order dependence
    out32, _, low = references(("zero", path), *batch, 128**-0.5)
    assert_flash_rule(first, out32, low)
    q, k_cache, v_cache, _, table, seq_lens = batch
    empty_cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    none = pagedkern.flash_prefill(q[:0], k_cache, v_cache, empty_cu, table[:0], seq_lens[:0])
    assert none.shape == (0, 8, 128)


def test_runs_on_the_callers_stream():
    batch = make_batch([(500, 100), (3, 0)], 4, 64, torch.float16, 16, seed=4)
    q = batch[0]
    g = torch.Generator(device=DEVICE).manual_seed(5)
    new_q = torch.randn(q.shape, generator=g, device=DEVICE).to(q.dtype)  # the same every run
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        q.copy_(new_q)
        out = pagedkern.flash_prefill(*batch)
    stream.synchronize()
    out32, _, low = references(("stream",), *batch, 64**-0.5)
    assert_flash_rule(out, out32, low)
