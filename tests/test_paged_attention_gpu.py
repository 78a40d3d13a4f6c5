"""paged_attention (decode) kernel vs the fp32 reference on the GPU: shuffled non-contiguous block
tables with NaN in every cache slot no sequence owns, lengths 1..16384, batches 1..129, split-KV
on and off, every dispatched head dim / block size / GQA ratio, padding rows, return_lse, views
into a fused QKV output, CUDA-graph capture with a fixed plan, the caller's stream, an error bound
per head (not only over all heads), and the policy outside kernel support (warn or refuse); each
on every kernel variant (PAGEDKERN_KERNELS=paged_attention:...)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from kernel_check import REL_TOLERANCE, assert_close_to, every_variant, poisoned

import pagedkern
from pagedkern import reference
from pagedkern.ops import launch
from pagedkern.ops.paged_attention import decode_kernel, plan_splits, workspace_size
from pagedkern.ops.support import KernelUnsupportedError

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# Every test on every variant: auto, simt, and mma (which also takes the small groups here).
kernel_variant = every_variant("paged_attention")


def paged_cache(seq_lens, hkv, block_size, d, dtype, seed, spare=3):
    """Random K/V pages in shuffled physical order; NaN in unowned slots and spare pages, which
    also fill the tables past each sequence's pages."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = [math.ceil(n / block_size) for n in seq_lens]
    total = sum(pages) + spare
    perm = torch.randperm(total, generator=g, device=DEVICE).tolist()
    k_cache = torch.randn(total, hkv, block_size, d, generator=g, device=DEVICE).to(dtype)
    v_cache = torch.randn(total, hkv, block_size, d, generator=g, device=DEVICE).to(dtype)
    tables = torch.full((len(seq_lens), max(pages) + 2), perm[-1], dtype=torch.int32)
    owned = [0] * total  # valid tokens per physical page
    start = 0
    for b, (n, count) in enumerate(zip(seq_lens, pages, strict=True)):
        tables[b, :count] = torch.tensor(perm[start : start + count], dtype=torch.int32)
        for i, page in enumerate(perm[start : start + count]):
            owned[page] = min(block_size, n - i * block_size)
        start += count
    keep = torch.arange(block_size)[None, :] < torch.tensor(owned)[:, None]
    keep = keep[:, None, :, None].to(DEVICE)
    k_cache.masked_fill_(~keep, math.nan)
    v_cache.masked_fill_(~keep, math.nan)
    return k_cache, v_cache, tables.to(DEVICE)


def check(seq_lens, dtype, d, block_size, hq, hkv, num_splits=None, seed=0, **kwargs):
    k_cache, v_cache, tables = paged_cache(seq_lens, hkv, block_size, d, dtype, seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), hq, d, generator=g, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, dtype, DEVICE)
    result, lse = pagedkern.paged_attention(
        q, k_cache, v_cache, tables, lens, out=out, return_lse=True, num_splits=num_splits, **kwargs
    )
    assert result is out and lse.dtype == torch.float32
    ref, ref_lse = reference.paged_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, lens, return_lse=True
    )
    assert_close_to(out, ref, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    padding = lens == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    return out


LENGTHS = [1, 15, 16, 17, 255, 1000, 4097, 16384, 0]


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_lengths_with_and_without_split_kv(num_splits):
    check(LENGTHS, torch.bfloat16, 128, 16, 32, 8, num_splits)


def _lengths(batch, high, seed):
    rng = random.Random(seed)
    return [rng.choice([0, rng.randint(1, high)]) if batch > 64 else rng.randint(1, high)
            for _ in range(batch)]  # fmt: skip


@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize(
    "seq_lens",
    [[16384], [17, 1000, 4097], _lengths(64, 4097, 1), _lengths(129, 1000, 2)],
    ids=["b1", "b3", "b64", "b129"],
)
def test_batch_sizes(seq_lens, num_splits):
    check(seq_lens, torch.float16, 128, 32, 32, 4, num_splits, seed=len(seq_lens))


# (dtype, head dim, block size, Hq, Hkv): every head dim, block size and GQA ratio 1..8, MQA.
CONFIGS = [
    (torch.bfloat16, 64, 16, 9, 3),
    (torch.float16, 64, 32, 32, 1),
    (torch.bfloat16, 64, 64, 14, 2),
    (torch.float16, 128, 16, 8, 8),
    (torch.bfloat16, 128, 32, 10, 2),
    (torch.float16, 128, 64, 12, 2),
    (torch.bfloat16, 128, 16, 16, 1),
    (torch.float16, 256, 16, 4, 2),
    (torch.bfloat16, 256, 32, 8, 1),
    (torch.float16, 256, 64, 6, 6),
    (torch.bfloat16, 128, 16, 56, 8),
    (torch.float16, 64, 16, 36, 1),
]


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype, d, block_size, hq, hkv", CONFIGS)
def test_head_dims_block_sizes_and_gqa_ratios(dtype, d, block_size, hq, hkv, num_splits):
    check([1, 17, 63, 300, 777, 0], dtype, d, block_size, hq, hkv, num_splits, seed=hq * d)


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_head_within_the_bound_on_its_own(dtype, num_splits):
    # A bug confined to one query head of 32 (or one KV head's group) hides under a relative
    # error taken over all heads at once: bound each (sequence, head) separately.
    seq_lens = [1, 17, 300, 1000, 4097]
    hq, hkv, d = 32, 8, 128
    k_cache, v_cache, tables = paged_cache(seq_lens, hkv, 16, d, dtype, seed=11)
    q = torch.randn(len(seq_lens), hq, d, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, dtype, DEVICE)
    pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, out=out, num_splits=num_splits)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens)
    assert not out.isnan().any()
    per_head = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    worst = per_head.max().item()
    b, h = divmod(int(per_head.argmax()), hq)
    assert worst <= REL_TOLERANCE[dtype], f"head {h} of sequence {b}: relative error {worst:.3g}"


def test_small_bound_on_the_lengths_stays_correct():
    # max_seq_len below the real lengths: the last split runs to the end (slower, still right).
    check([3000, 20, 700], torch.bfloat16, 128, 16, 8, 2, max_seq_len=512)


def test_padding_rows_read_nothing():
    # Padding entries: zero length and block tables full of page ids far out of range.
    k_cache, v_cache, _ = paged_cache([40], 2, 16, 128, torch.bfloat16, 5)
    tables = torch.full((4, 8), 2**30, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, 8, 128, device=DEVICE).bfloat16()
    for splits in (1, 4):
        out, lse = pagedkern.paged_attention(
            q, k_cache, v_cache, tables, lens, return_lse=True, num_splits=splits,
            max_seq_len=1024,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_fused_qkv_views():
    # As the model calls it: q a view into the QKV GEMM output, out a view of a larger buffer.
    seq_lens, hq, hkv, d = [5, 300, 17], 16, 4, 128
    k_cache, v_cache, tables = paged_cache(seq_lens, hkv, 16, d, torch.bfloat16, 6)
    qkv = torch.randn(7, (hq + 2 * hkv) * d, device=DEVICE).bfloat16()
    q = qkv[4:, : hq * d].view(3, hq, d)
    out_all = poisoned((7, hq, d), torch.bfloat16, DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, out=out_all[4:])
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens)
    assert_close_to(out_all[4:], ref, torch.bfloat16)
    assert out_all[:4].isnan().all(), "wrote outside its rows"


def test_cuda_graph_capture_with_a_fixed_plan():
    # Fixed max_seq_len + caller workspace: one grid for every replay, whatever the lengths.
    batch, hq, hkv, d, bs, max_len = 4, 32, 8, 128, 16, 8192
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_splits(batch, hq, hkv, d, max_len, sms, kernel=decode_kernel(hq // hkv, d))
    assert plan.num_splits > 1
    workspace = torch.empty(workspace_size(batch, hq, d, plan.num_splits), device=DEVICE)
    k_cache, v_cache, tables = paged_cache([max_len] * batch, hkv, bs, d, torch.bfloat16, 7)
    q = torch.randn(batch, hq, d, device=DEVICE).bfloat16()
    lens = torch.full((batch,), max_len, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)

    def step():
        pagedkern.paged_attention(
            q, k_cache, v_cache, tables, lens, out=out, max_seq_len=max_len, workspace=workspace
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in ([1, 8192, 4000, 0], [700, 16, 17, 8191]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        out.fill_(math.nan)
        graph.replay()
        ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens)
        assert_close_to(out, ref, torch.bfloat16)


def test_runs_on_the_callers_stream():
    k_cache, v_cache, tables = paged_cache([2048, 100], 8, 16, 128, torch.bfloat16, 8)
    lens = torch.tensor([2048, 100], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 32, 128, device=DEVICE).bfloat16()
    new_q = torch.randn_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        q.copy_(new_q)
        out = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
    stream.synchronize()
    ref = reference.paged_attention(new_q.float(), k_cache.float(), v_cache.float(), tables, lens)
    assert_close_to(out, ref, torch.bfloat16)


def test_float32_runs_on_the_reference_and_misaligned_rows_are_rejected(monkeypatch):
    # Outside kernel support: "auto" warns and runs the reference, "cuda" refuses.
    k_cache, v_cache, tables = paged_cache([30], 2, 16, 64, torch.float32, 9)
    lens = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    monkeypatch.setattr(launch, "_warned", set())
    with pytest.warns(RuntimeWarning, match="paged_attention runs the PyTorch reference"):
        out = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out, reference.paged_attention(q, k_cache, v_cache, tables, lens))
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError, match="float32"):
        pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
    k16, v16 = k_cache.half(), v_cache.half()
    base = torch.randn(4 * 64 + 1, device=DEVICE).half()
    q_odd = base[1:].view(1, 4, 64)  # 2-byte offset
    with pytest.raises(ValueError, match="16-byte"):
        pagedkern.paged_attention(q_odd, k16, v16, tables, lens)
