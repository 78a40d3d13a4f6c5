"""The MoE reference (reference/moe.py) and its ops entry against a naive float64 loop over
tokens, over odd shapes: E not a power of two, top-k = E, one token, experts that receive no
token, one expert that receives every token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkern import ops, reference


def naive_moe(x, logits, w_gate_up, w_down, top_k, renormalize, activation="silu"):
    """Token by token, expert by expert, in float64."""
    x, logits = x.double(), logits.double()
    w_gate_up, w_down = w_gate_up.double(), w_down.double()
    inter = w_down.shape[-1]
    act = F.silu if activation == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], -1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            gu = w_gate_up[e] @ x[t]
            out[t] += w * (w_down[e] @ (act(gu[:inter]) * gu[inter:]))
    return out


def _operands(tokens, experts, hidden=24, inter=20, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g) * 2
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return x, logits, w_gate_up, w_down


@pytest.mark.parametrize(
    "tokens, experts, top_k",
    [(7, 5, 2), (1, 3, 2), (13, 6, 6), (9, 7, 3), (1, 1, 1), (33, 12, 4)],
    ids=["E5k2", "one-token", "k=E", "E7k3", "E1", "E12k4"],
)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_fused_moe_equals_a_per_token_loop(tokens, experts, top_k, renormalize):
    x, logits, gu, down = _operands(tokens, experts)
    want = naive_moe(x, logits, gu, down, top_k, renormalize)
    got = ops.fused_moe(x, logits, gu, down, top_k, renormalize=renormalize)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_and_one_expert_taking_all():
    # logits that send every token to experts 4 (first) and 1 (second): the others get none
    x, logits, gu, down = _operands(10, 6)
    logits = torch.full_like(logits, -5.0)
    logits[:, 4], logits[:, 1] = 5.0, 3.0
    weights, ids = reference.moe_route(logits, 2, True)
    assert ids[:, 0].eq(4).all() and ids[:, 1].eq(1).all()
    want = naive_moe(x, logits, gu, down, 2, True)
    got = ops.fused_moe(x, logits, gu, down, 2).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # top-1 of an expert that takes all: that expert's MLP itself, weight 1
    one = ops.fused_moe(x, logits, gu, down, 1)
    inter = down.shape[-1]
    a = x @ gu[4].T
    torch.testing.assert_close(one, (F.silu(a[:, :inter]) * a[:, inter:]) @ down[4].T)


def test_gelu_and_half_precision():
    x, logits, gu, down = _operands(8, 5, dtype=torch.bfloat16)
    want = naive_moe(x, logits, gu, down, 2, False, "gelu_tanh")
    got = ops.fused_moe(x, logits, gu, down, 2, renormalize=False, activation="gelu_tanh")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_route_weights_sum_to_one_when_renormalised():
    _, logits, _, _ = _operands(16, 9)
    weights, ids = reference.moe_route(logits, 3, True)
    assert weights.dtype == torch.float32 and ids.shape == (16, 3)
    torch.testing.assert_close(weights.sum(-1), torch.ones(16))
    order, counts = reference.moe.group_by_expert(ids, 9)
    assert counts.sum() == 48 and torch.equal(ids.reshape(-1)[order], ids.reshape(-1).sort()[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(top_k=0), "top_k"),
        (dict(top_k=6), "top_k"),
        (dict(router_logits=torch.zeros(7, 4)), "router_logits"),
        (dict(w_down=torch.zeros(5, 24, 21)), "w_down"),
        (dict(w_gate_up=torch.zeros(5, 41, 24)), "w_gate_up"),
        (dict(hidden=torch.zeros(7, 24, dtype=torch.int32)), "hidden"),
        (dict(w_down=torch.zeros(5, 24, 20, dtype=torch.float16)), "w_down"),
        (dict(activation="relu"), "activation"),
    ],
)
def test_arguments_are_checked_by_name(change, message):
    x, logits, gu, down = _operands(7, 5)
    args = dict(hidden=x, router_logits=logits, w_gate_up=gu, w_down=down, top_k=2)
    args.update(change)
    with pytest.raises((TypeError, ValueError), match=message):
        ops.fused_moe(**args)
