"""The moe_gemm:sm90_wgmma variant on the GPU (csrc/moe_gemm_sm90.cu: the experts' grouped
GEMMs on wgmma + TMA) against the reference on the same CUDA tensors, every buffer ops.moe
allocates poisoned with NaN first: odd shapes (E not a power of two, tokens = 1, top_k = E, an
expert with no token and one with all of them, K and N tails past both consumers' columns),
gpt-oss's biases and clamped SwiGLU, both dtypes, one and two consumer warpgroups, on a side
stream and captured in a CUDA graph. On a GPU other than sm_90 only the refusal is tested.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_check import REL_TOLERANCE, relative_error
from support.moe_buffers import poison_moe_buffers
from support.moe_gpu import (
    assert_graph_replays,
    float_operands,
    gpt_oss_options,
    on_a_side_stream,
)

from pagedkern import reference
from pagedkern.ops import moe

pytestmark = pytest.mark.gpu


@pytest.fixture
def sm90(kernels, monkeypatch):
    """The variant selected and every ops.moe buffer poisoned; sm_90 GPUs only."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma + TMA kernels run on sm_90 only (test_refused_elsewhere)")
    kernels(moe_gemm="sm90_wgmma")
    poison_moe_buffers(monkeypatch)


def _check(args, top_k, dtype, **kwargs):
    out = moe.fused_moe(*args, top_k, **kwargs)
    want = reference.fused_moe(*args, top_k, **kwargs)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]
    return out


# consumers per CTA: 2 where T*k >= 32 E (ops/moe.moe_tile_m's prefill rule), else 1
CASES = [  # tokens, experts, top_k, hidden, inter, activation
    (1, 8, 2, 72, 40, "silu"),  # tokens = 1; K = 72 and N = 40 past a 64-wide step and a box
    (3, 60, 8, 136, 24, "gelu_tanh"),  # E not a power of two, most experts without a token
    (17, 6, 6, 200, 136, "silu"),  # top_k = E: every expert takes every token
    (96, 5, 5, 128, 264, "gelu_tanh"),  # top_k = E, two consumers; N ends in the second's
    (300, 12, 4, 264, 520, "silu"),  # two consumers, several row tiles an expert, K, N tails
    (64, 128, 8, 2048, 768, "silu"),  # Qwen3-30B-A3B decode
    (512, 128, 8, 2048, 768, "silu"),  # ... prefill-shaped (two consumers)
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, activation", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equals_the_reference(sm90, tokens, experts, top_k, hidden, inter, activation, dtype):
    args = float_operands(tokens, experts, hidden, inter, dtype)
    _check(args, top_k, dtype, activation=activation)


@pytest.mark.parametrize("tokens", [1, 40, 200])
def test_an_expert_with_no_token_and_one_with_all(sm90, tokens):
    x, logits, gu, down = float_operands(tokens, 7, 96, 56, torch.bfloat16, seed=tokens)
    logits[:, 0] = -30.0  # expert 0: never chosen
    logits[:, 3] = 30.0  # expert 3: chosen by every token
    _, ids = moe.moe_route(logits, 2)
    assert (ids == 3).any(dim=1).all() and not (ids == 0).any()
    _check((x, logits, gu, down), 2, torch.bfloat16)


# gpt-oss: softmax over the top-k, expert biases, the clamped SwiGLU (gpt-oss-20b's experts)
GPT_OSS_CASES = [(1, 32, 4, 2880, 2880), (17, 8, 8, 136, 24), (256, 32, 4, 2880, 2880)]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", GPT_OSS_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_mode_equals_the_reference(sm90, tokens, experts, top_k, hidden, inter, dtype):
    x, logits, gu, down = float_operands(tokens, experts, hidden, inter, dtype, seed=tokens)
    kwargs = gpt_oss_options(experts, hidden, inter, dtype)
    _check((x, logits, gu * 3, down), top_k, dtype, **kwargs)  # gate/up past the limit


def test_hidden_rows_with_a_stride(sm90):
    x, logits, gu, down = float_operands(33, 16, 128, 64, torch.bfloat16)
    wide = torch.zeros(33, 200, dtype=torch.bfloat16, device="cuda")
    wide[:, 8:136] = x
    _check((wide[:, 8:136], logits, gu, down), 4, torch.bfloat16)


def test_agrees_with_the_default_kernels(sm90, kernels):
    args = float_operands(64, 60, 512, 192, torch.bfloat16, seed=5)
    got = moe.fused_moe(*args, 4)
    kernels(moe_gemm="no_split_k")  # the mma.sync kernels, one K split
    want = moe.fused_moe(*args, 4)
    assert relative_error(got, want) <= REL_TOLERANCE[torch.bfloat16]


def test_on_a_side_stream(sm90):
    args = float_operands(33, 16, 256, 128, torch.bfloat16)
    got, want = on_a_side_stream(args, 4)
    assert torch.equal(got, want)  # deterministic: no atomics, a fixed summation order


def test_captured_in_a_cuda_graph(sm90):
    assert_graph_replays(float_operands(8, 60, 256, 96, torch.bfloat16), 4, reference.fused_moe)


def test_refused_elsewhere(kernels):
    if torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU runs the variant (the tests above)")
    kernels(moe_gemm="sm90_wgmma")
    args = float_operands(4, 8, 64, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        moe.fused_moe(*args, 2)
