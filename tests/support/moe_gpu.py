"""What the MoE GPU tests share (test_moe_kernels_gpu, test_moe_sm90_gpu, test_moe_quant_gpu):
random float operands on the GPU, gpt-oss's options with random expert biases, fused_moe on a
side stream, and fused_moe captured in a CUDA graph and replayed with new inputs."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from kernel_check import REL_TOLERANCE, relative_error

from pagedkern.ops import moe

from . import moe_operands
from .moe_operands import Operands

# (x, router logits, w_gate_up, w_down) on the GPU
float_operands = functools.partial(moe_operands.float_operands, device="cuda")


def gpt_oss_options(experts, hidden, inter, dtype) -> dict:
    """fused_moe's gpt-oss keywords: softmax over the top-k, the clamped SwiGLU, random biases."""
    g = torch.Generator(device="cuda").manual_seed(experts)
    gub = (torch.randn(experts, 2 * inter, generator=g, device="cuda") * 0.5).to(dtype)
    db = (torch.randn(experts, hidden, generator=g, device="cuda") * 0.5).to(dtype)
    return dict(
        renormalize=False, scoring="softmax_topk", activation="clamped_swiglu",
        swiglu_alpha=1.702, swiglu_limit=1.0, w_gate_up_bias=gub, w_down_bias=db,
    )  # fmt: skip


def on_a_side_stream(args, top_k) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused_moe on a side stream ordered after the current one, fused_moe on the current)."""
    want = moe.fused_moe(*args, top_k)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = moe.fused_moe(*args, top_k)
    side.synchronize()
    return got, want


def assert_graph_replays(operands: Operands, top_k: int, expected: Callable, **kwargs) -> None:
    """fused_moe(*operands, top_k, **kwargs) warmed up, captured in a CUDA graph (no host
    synchronisation inside), then replayed with new x and logits: each replay's output within
    bf16's tolerance of expected(x, logits, w_gate_up, w_down, top_k)."""
    x, logits, gu, down = operands
    moe.fused_moe(x, logits, gu, down, top_k, **kwargs)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # (on torch's capture stream: the op launches on it)
        out = moe.fused_moe(x, logits, gu, down, top_k, **kwargs)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        logits.copy_(torch.randn(logits.shape, generator=g, device="cuda") * 2)
        graph.replay()
        torch.cuda.synchronize()
        want = expected(x, logits, gu, down, top_k)
        assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]
