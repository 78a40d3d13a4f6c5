"""The reference MoE ops in gpt-oss's mode against transformers' GptOssMLP on the same weights:
the router with bias and the softmax over the top-k, the clamped SwiGLU, expert biases;
odd shapes (E = 5 and 7, k = 2 and E, T = 1 and 13)."""

from __future__ import annotations

import pytest
import torch

from pagedkern import reference
from pagedkern.reference.moe import clamped_swiglu

transformers = pytest.importorskip("transformers")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


def test_clamped_swiglu_equals_transformers_gate():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 11, generator=g) * 6  # many values past the limit
    config = transformers.GptOssConfig(intermediate_size=11, swiglu_limit=3.0, swiglu_alpha=1.3)
    want = gpt_oss.GptOssExperts(config)._apply_gate(gate_up)  # interleaved gate/up columns
    got = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], alpha=1.3, limit=3.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (gate_up.abs() > 3).any()  # (the clamps acted)


@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("experts, top_k", [(5, 2), (7, 7)])
def test_fused_moe_equals_transformers_gpt_oss_mlp(tokens, experts, top_k):
    hidden, inter = 24, 10
    config = transformers.GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
        num_experts_per_tok=top_k, swiglu_limit=2.0,
    )  # fmt: skip
    torch.manual_seed(tokens + experts)
    mlp = gpt_oss.GptOssMLP(config).float().eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    x = torch.randn(1, tokens, hidden)
    with torch.no_grad():
        want, _ = mlp(x)
    ex = mlp.experts
    gate_up = ex.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], rows interleaved
    bias = ex.gate_up_proj_bias.detach()
    logits = torch.nn.functional.linear(x[0], mlp.router.weight, mlp.router.bias).detach()
    got = reference.fused_moe(
        x[0], logits,
        torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1),
        ex.down_proj.detach().transpose(1, 2).contiguous(),
        top_k, renormalize=False, activation="clamped_swiglu", scoring="softmax_topk",
        w_gate_up_bias=torch.cat([bias[:, 0::2], bias[:, 1::2]], 1),
        w_down_bias=ex.down_proj_bias.detach(), swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=2.0,
    )  # fmt: skip
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def test_softmax_topk_weights_are_the_softmax_of_the_selected_logits():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, 0.0, -1.0, 5.0]])
    weights, ids = reference.moe_route(logits, 2, False, "softmax_topk")
    assert ids.tolist() == [[1, 3], [3, 0]]
    want = torch.softmax(torch.tensor([[4.0, 3.0], [5.0, 0.0]]), -1)
    torch.testing.assert_close(weights, want)
    full, _ = reference.moe_route(logits, 2, False, "softmax")
    assert not torch.allclose(full, want)  # (a different mode than the full softmax's)
