"""The MoE kernels on the GPU (csrc/moe_route.cu, csrc/moe_gemm.cu) against the reference run
on the same CUDA tensors: router ids exactly, the grouping's layout exactly, the layer within
the dtype's tolerance at odd and model shapes (Qwen3-30B-A3B's and Mixtral's experts), on a
side stream, and captured in a CUDA graph (no host synchronisation) and replayed with new
inputs; split-K at forced (uneven) and chosen factors and under moe_gemm:no_split_k. Skipped
without a GPU."""

from __future__ import annotations

import functools

import pytest
import torch
from kernel_check import REL_TOLERANCE, relative_error
from support.moe_gpu import (
    assert_graph_replays,
    float_operands,
    gpt_oss_options,
    on_a_side_stream,
)

from pagedkern import reference
from pagedkern.ops import moe
from pagedkern.reference.moe import align_by_expert

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 3, 17, 2048])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (60, 4), (128, 8), (512, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_ids_exact(tokens, experts, top_k, dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens + experts)
    logits = (torch.randn(tokens, experts, generator=g, device="cuda") * 3).to(dtype)
    logits[0, :] = 1.0  # a token with every expert tied
    for scoring in ("softmax", "sigmoid"):
        weights, ids = moe.moe_route(logits, top_k, scoring=scoring)
        want_w, want_ids = reference.moe_route(logits, top_k, True, scoring)
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (64, 128, 8), (2048, 128, 8)])
@pytest.mark.parametrize("tile_m", [16, 64])
def test_grouping_layout_exact(tokens, experts, top_k, tile_m):
    logits = torch.randn(tokens, experts, device="cuda")
    _, ids = moe.moe_route(logits, top_k)
    sorted_pairs, tile_expert = moe.moe_align(ids, experts, tile_m)
    want = align_by_expert(ids, experts, tile_m)
    assert torch.equal(sorted_pairs, want[0]) and torch.equal(tile_expert, want[1])


CASES = [  # tokens, experts, top_k, hidden, inter
    (1, 8, 2, 72, 40),
    (3, 60, 8, 37, 23),
    (17, 8, 8, 200, 136),
    (64, 128, 8, 2048, 768),  # Qwen3-30B-A3B decode
    (512, 128, 8, 2048, 768),
    (4, 8, 2, 4096, 14336),  # Mixtral decode
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", CASES)
@pytest.mark.parametrize("tile_m", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_equals_the_reference(tokens, experts, top_k, hidden, inter, tile_m, dtype):
    args = float_operands(tokens, experts, hidden, inter, dtype)
    out = moe.fused_moe(*args, top_k, tile_m=tile_m)
    want = reference.fused_moe(*args, top_k)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


def test_fused_moe_on_a_side_stream():
    args = float_operands(33, 16, 256, 128, torch.bfloat16)
    got, want = on_a_side_stream(args, 4)
    assert torch.equal(got, want)  # deterministic: no atomics in the combine


def test_fused_moe_captured_in_a_cuda_graph():
    assert_graph_replays(float_operands(8, 60, 256, 96, torch.bfloat16), 4, reference.fused_moe)


# gpt-oss: softmax over the top-k, expert biases, the clamped SwiGLU (gpt-oss-20b's experts:
# 32 of 2880 x 2880, top-4; gpt-oss-120b's: 128, top-4)
GPT_OSS_CASES = [(1, 32, 4, 2880, 2880), (17, 8, 8, 37, 23), (256, 128, 4, 2880, 2880)]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", GPT_OSS_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_mode_equals_the_reference(tokens, experts, top_k, hidden, inter, dtype):
    x, logits, gu, down = float_operands(tokens, experts, hidden, inter, dtype, seed=tokens)
    kwargs = gpt_oss_options(experts, hidden, inter, dtype)
    weights, ids = moe.moe_route(logits, top_k, scoring="softmax_topk")
    want_w, want_ids = reference.moe_route(logits, top_k, False, "softmax_topk")
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)
    out = moe.fused_moe(x, logits, gu * 3, down, top_k, **kwargs)  # gate/up past the limit
    want = reference.fused_moe(x, logits, gu * 3, down, top_k, **kwargs)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


# Split-K (csrc/moe_gemm_pipeline.cuh): forced split factors, including ones that do not divide
# the K steps evenly, at Qwen3-30B-A3B's decode shapes and odd ones; the default (moe_split_k's
# choice) and the moe_gemm:no_split_k variant at the same shapes.
SPLIT_CASES = [  # tokens, experts, top_k, hidden, inter, (gate_up, down) splits
    (1, 128, 8, 2048, 768, (6, 3)),  # Qwen3-30B-A3B decode, moe_split_k's choice
    (3, 128, 8, 2048, 768, (5, 7)),  # 64 / 24 K steps: uneven splits
    (64, 128, 8, 2048, 768, (2, 2)),
    (3, 60, 60, 200, 136, (3, 5)),  # k = E, E not a power of two; 7 / 5 K steps
    (1, 7, 2, 37, 23, (2, 1)),  # element loads
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, splits", SPLIT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_k_equals_the_reference(tokens, experts, top_k, hidden, inter, splits, dtype):
    args = float_operands(tokens, experts, hidden, inter, dtype, seed=tokens + experts)
    out = moe.fused_moe(*args, top_k, split_k=splits)
    again = moe.fused_moe(*args, top_k, split_k=splits)
    want = reference.fused_moe(*args, top_k)
    assert not torch.isnan(out).any()
    assert torch.equal(out, again)  # split order: deterministic
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


@pytest.mark.parametrize("variant", ["split_k", "no_split_k"])
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_decode_shapes_under_each_split_variant(kernels, variant, tokens):
    kernels(moe_gemm=variant)
    args = float_operands(tokens, 128, 2048, 768, torch.bfloat16, seed=tokens)
    out = moe.fused_moe(*args, 8)
    want = reference.fused_moe(*args, 8)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_split_k_with_gpt_oss_biases_captured_in_a_cuda_graph():
    operands = float_operands(2, 32, 2880, 2880, torch.bfloat16, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    kwargs = dict(
        renormalize=False, scoring="softmax_topk", activation="clamped_swiglu",
        w_gate_up_bias=(torch.randn(32, 5760, generator=g, device="cuda") * 0.5).bfloat16(),
        w_down_bias=(torch.randn(32, 2880, generator=g, device="cuda") * 0.5).bfloat16(),
    )  # fmt: skip
    want = functools.partial(reference.fused_moe, **kwargs)
    assert_graph_replays(operands, 4, want, split_k=(4, 3), **kwargs)
