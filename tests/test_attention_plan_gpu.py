"""Plan/run attention on the GPU (ops/attention_plan.py): per layer, run() equals the one-shot
kernels bit for bit (decode with and without split-KV, prefill on the path the GPU takes), on a
side stream too, and a decode step of runs captured in a CUDA graph replays to the same
output."""

from __future__ import annotations

import pytest
import torch
from test_attention_plan import _decode_case, _prefill_case

import pagedkern
from pagedkern.ops.attention_plan import DecodeAttention, PrefillAttention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_runs_equal_the_one_shot_kernel(dtype, num_splits):
    qs, caches, table, lens = _decode_case(dtype, lens=(700, 1, 3000))
    qs, caches = [q.cuda() for q in qs], [[c.cuda() for c in kv] for kv in caches]
    table, lens = table.cuda(), lens.cuda()
    out = torch.empty_like(qs[0])
    plan = DecodeAttention()
    plan.plan(qs[0], *caches[0], table, lens, out, num_splits=num_splits)
    side = torch.cuda.Stream()
    for i, (q, (k, v)) in enumerate(zip(qs, caches, strict=True)):
        want = pagedkern.paged_attention(q, k, v, table, lens, num_splits=num_splits)
        out.fill_(float("nan"))
        if i == 1:  # on a side stream: the run is ordered on the stream it is given
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                plan.run(q, k, v, out)
            torch.cuda.current_stream().wait_stream(side)
        else:
            plan.run(q, k, v, out)
        assert torch.equal(out, want)


def test_a_decode_step_of_runs_replays_from_a_cuda_graph():
    qs, caches, table, lens = _decode_case(torch.bfloat16, lens=(900, 17, 64))
    qs, caches = [q.cuda() for q in qs], [[c.cuda() for c in kv] for kv in caches]
    table, lens = table.cuda(), lens.cuda()
    outs = [torch.empty_like(q) for q in qs]
    plan = DecodeAttention()
    plan.plan(qs[0], *caches[0], table, lens, outs[0], num_splits=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        for q, (k, v), out in zip(qs, caches, outs, strict=True):
            plan.run(q, k, v, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for q, (k, v), out in zip(qs, caches, outs, strict=True):
            plan.run(q, k, v, out)
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for q, (k, v), out in zip(qs, caches, outs, strict=True):
        assert torch.equal(out, pagedkern.paged_attention(q, k, v, table, lens, num_splits=3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_runs_equal_the_one_shot_kernel(dtype):
    qs, caches, cu, table, lens = _prefill_case(dtype)
    qs, caches = [q.cuda() for q in qs], [[c.cuda() for c in kv] for kv in caches]
    cu, table, lens = cu.cuda(), table.cuda(), lens.cuda()
    out = torch.empty_like(qs[0])
    plan = PrefillAttention()
    plan.plan(qs[0], *caches[0], cu, table, lens, out)
    for q, (k, v) in zip(qs, caches, strict=True):
        want = pagedkern.flash_prefill(q, k, v, cu, table, lens)
        out.fill_(float("nan"))
        assert torch.equal(plan.run(q, k, v, out), want)
    assert plan.path in ("sm80", "sm90")
