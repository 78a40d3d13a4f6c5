"""The quantized-experts MoE kernel on the GPU (csrc/moe_gemm_quant.cu, W4A16 / W8A16) against
the float reference over the weights it multiplies (moe_quant_check), run on the same CUDA
tensors: odd and model shapes (Qwen3-30B-A3B's experts at decode and prefill), both row tiles,
int4 at G = 32 and 128, int8; on a side stream (deterministic), and captured in a CUDA graph;
split-K at forced (uneven) factors and under both moe_gemm split variants.
Skipped without a GPU. Not yet run on one."""

from __future__ import annotations

import pytest
import torch
from kernel_check import REL_TOLERANCE, relative_error
from moe_quant_check import expected, quantized_operands
from support.moe_gpu import assert_graph_replays, on_a_side_stream

from pagedkern.ops import moe

pytestmark = pytest.mark.gpu

CASES = [  # tokens, experts, top_k, hidden, inter
    (1, 8, 2, 64, 32),
    (3, 60, 8, 96, 64),
    (17, 8, 8, 256, 160),
    (64, 128, 8, 2048, 768),  # Qwen3-30B-A3B decode
    (1024, 128, 8, 2048, 768),  # ... prefill
]
FORMATS = [("int4", 32), ("int4", 128), ("int8", 0)]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", CASES)
@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("tile_m", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_experts_equal_the_reference(tokens, experts, top_k, hidden, inter, fmt,
                                               group, tile_m, dtype):  # fmt: skip
    if fmt == "int4" and (hidden % group or inter % group):
        pytest.skip(f"H {hidden}, I {inter} not multiples of G {group}")
    args = quantized_operands(tokens, experts, hidden, inter, dtype, fmt, group or 32,
                              seed=tokens + experts, device="cuda")  # fmt: skip
    out = moe.fused_moe(*args, top_k, tile_m=tile_m)
    want = expected(*args, top_k)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


def test_on_a_side_stream_and_deterministic():
    args = quantized_operands(33, 16, 256, 128, torch.bfloat16, "int4", 32, seed=1, device="cuda")
    got, want = on_a_side_stream(args, 4)
    assert torch.equal(got, want)


def test_captured_in_a_cuda_graph():
    operands = quantized_operands(8, 60, 256, 96, torch.bfloat16, "int8", 0, seed=2,
                                  device="cuda")  # fmt: skip
    assert_graph_replays(operands, 4, expected)  # the warm-up packs the kernel operands once


# Split-K (csrc/moe_gemm_pipeline.cuh) over quantized experts: forced uneven split factors at
# Qwen3-30B-A3B's decode shapes, int4 at both group sizes (groups across split edges) and int8
# (the channel scale applied to each split's partial); the default against moe_gemm:no_split_k.
@pytest.mark.parametrize("tokens, splits", [(1, (6, 3)), (3, (5, 7)), (64, (2, 2))])
@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_k_equals_the_reference(tokens, splits, fmt, group, dtype):
    args = quantized_operands(tokens, 128, 2048, 768, dtype, fmt, group or 32, seed=tokens,
                              device="cuda")  # fmt: skip
    out = moe.fused_moe(*args, 8, split_k=splits)
    assert not torch.isnan(out).any()
    assert torch.equal(out, moe.fused_moe(*args, 8, split_k=splits))
    assert relative_error(out, expected(*args, 8)) <= REL_TOLERANCE[dtype]


@pytest.mark.parametrize("variant", ["split_k", "no_split_k"])
@pytest.mark.parametrize("fmt, group", FORMATS)
def test_decode_under_each_split_variant(kernels, variant, fmt, group):
    kernels(moe_gemm=variant)
    args = quantized_operands(4, 128, 2048, 768, torch.bfloat16, fmt, group or 32, seed=4,
                              device="cuda")  # fmt: skip
    out = moe.fused_moe(*args, 8)
    assert not torch.isnan(out).any()
    assert relative_error(out, expected(*args, 8)) <= REL_TOLERANCE[torch.bfloat16]
