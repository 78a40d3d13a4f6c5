"""gpt-oss's MoE modes in the kernels (csrc/moe_route.cu: softmax over the top-k; csrc/
moe_gemm.cu: expert biases in both GEMMs' epilogues, the clamped SwiGLU) on the CPU through
the emulator, against the reference: router ids exactly (ties included) and weights within
fp32 rounding; the layer over odd shapes (T = 1, 3, 17; E = 5, 8, 60; k = 1, 2, E; H and I
not multiples of the tiles, both row tiles, both load paths) with gate/up values well past
the clamp limit. Every buffer the op allocates starts poisoned (NaN / -7)."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from kernel_check import REL_TOLERANCE, relative_error
from support.moe_buffers import poison_moe_buffers

from pagedkern import reference
from pagedkern.ops import moe

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    poison_moe_buffers(monkeypatch)


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("experts, top_k", [(8, 1), (8, 4), (5, 5), (60, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_softmax_over_the_top_k(tokens, experts, top_k, dtype):
    g = torch.Generator().manual_seed(tokens * 10 + experts + top_k)
    logits = (torch.randn(tokens, experts, generator=g) * 3).to(dtype)
    if tokens >= 3:
        logits[0] = 0.25  # every expert tied
        logits[2] = torch.randint(0, 3, (experts,), generator=g).to(dtype)  # many ties
    for renormalize in (False, True):  # (the top-k softmax sums to 1 either way)
        with emulated():
            weights, ids = moe.moe_route(
                logits, top_k, renormalize=renormalize, scoring="softmax_topk"
            )
        want_w, want_ids = reference.moe_route(logits, top_k, False, "softmax_topk")
        assert torch.equal(ids.long(), want_ids)
        assert not torch.isnan(weights).any()
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)
    full, _ = reference.moe_route(logits, top_k, False, "softmax")
    if top_k < experts:  # (a mode of its own: not the full softmax's weights)
        assert not torch.allclose(full, want_w)


def _operands(tokens, experts, hidden, inter, dtype, seed):
    """Weights scaled so gate/up run to ~3x the clamp limit used below (1.5), biases ~0.5."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g) * 2
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 2 * hidden**-0.5
    w_down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    gate_up_bias = (torch.randn(experts, 2 * inter, generator=g) * 0.5).to(dtype)
    down_bias = (torch.randn(experts, hidden, generator=g) * 0.5).to(dtype)
    return (x, logits, w_gate_up.to(dtype), w_down), (gate_up_bias, down_bias)


GPT_OSS = dict(scoring="softmax_topk", activation="clamped_swiglu", swiglu_alpha=1.702,
               swiglu_limit=1.5)  # fmt: skip

CASES = [  # tokens, experts, top_k, hidden, inter, tile_m
    (1, 8, 2, 72, 40, 16),  # decode; H, I multiples of 8 (16-byte loads), not of the tiles
    (3, 60, 2, 40, 24, 16),
    (17, 8, 1, 72, 136, 16),  # I past two n tiles
    (17, 5, 5, 37, 23, 16),  # odd H and I: element loads; k = E
    (17, 8, 4, 48, 40, 64),  # the 64-row tile
    (3, 8, 2, 37, 23, 64),
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tile_m", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_layer_equals_the_reference(tokens, experts, top_k, hidden, inter, tile_m,
                                            dtype):  # fmt: skip
    args, (gub, db) = _operands(tokens, experts, hidden, inter, dtype, tokens * experts + hidden)
    kwargs = dict(renormalize=False, w_gate_up_bias=gub, w_down_bias=db, **GPT_OSS)
    with emulated():
        out = moe.fused_moe(*args, top_k, tile_m=tile_m, **kwargs)
    want = reference.fused_moe(*args, top_k, **kwargs)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]
    # the clamps and the biases each matter at this tolerance (the comparison can fail)
    for change in (dict(swiglu_limit=100.0), dict(w_down_bias=None), dict(w_gate_up_bias=None)):
        other = reference.fused_moe(*args, top_k, **(kwargs | change))
        assert relative_error(other, want) > 4 * REL_TOLERANCE[dtype], change


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_biases_with_the_other_activations(activation):
    args, (gub, db) = _operands(5, 12, 40, 24, torch.bfloat16, seed=9)
    kwargs = dict(activation=activation, w_gate_up_bias=gub, w_down_bias=db)
    with emulated():
        out = moe.fused_moe(*args, 3, **kwargs)
    want = reference.fused_moe(*args, 3, **kwargs)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_one_bias_alone():
    args, (gub, _) = _operands(7, 6, 40, 24, torch.bfloat16, seed=4)
    with emulated():
        out = moe.fused_moe(*args, 2, w_gate_up_bias=gub, **GPT_OSS)
    want = reference.fused_moe(*args, 2, w_gate_up_bias=gub, **GPT_OSS)
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_bias_arguments_are_checked():
    args, (gub, db) = _operands(2, 4, 16, 8, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="w_gate_up_bias"):
        moe.fused_moe(*args, 2, w_gate_up_bias=gub[:, :8])
    with pytest.raises(TypeError, match="w_down_bias"):
        moe.fused_moe(*args, 2, w_down_bias=db.float())
    with pytest.raises(ValueError, match="swiglu_limit"):
        moe.fused_moe(*args, 2, activation="clamped_swiglu", swiglu_limit=0.0)
