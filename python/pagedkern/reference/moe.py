"""Mixture-of-experts MLP: the router (softmax over experts, top-k, optional renormalisation)
and the experts' gated MLPs applied to the tokens routed to them, combined by routing weight.

Operands: hidden [T, H]; router_logits [T, E]; w_gate_up [E, 2I, H] (each expert's gate rows
then up rows, the halves silu_and_mul expects); w_down [E, H, I]. Tokens are grouped by expert
with one sort (no loop over tokens); the loop runs over the experts that received tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax over the E experts in fp32,
    the k largest probabilities (ties: torch.topk's order), divided by their sum if
    `renormalize` (Mixtral; Qwen's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k], counts [E]): the flat (token, slot) pairs sorted by expert (stable, so each
    expert's tokens keep their order) and how many each expert received. order // k is the
    token of each sorted pair."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """out[t] = sum over t's top-k experts e of weight[t, e] * down_e(act(gate_e(x)) * up_e(x)),
    [T, H] in hidden's dtype. The GEMMs run in hidden's dtype (as the dense MLP's do), the
    activation in fp32 rounded once, the weighted sum in fp32 rounded once at the end."""
    tokens, num_experts = hidden.shape[0], w_gate_up.shape[0]
    inter = w_down.shape[-1]
    weights, ids = moe_route(router_logits, top_k, renormalize)
    order, counts = group_by_expert(ids, num_experts)
    token_of = order // top_k
    x = hidden[token_of]  # [T*k, H], grouped by expert
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    act = ACTIVATIONS[activation]
    start = 0
    for e, n in enumerate(counts.tolist()):  # (host sync: fine for the reference)
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate_up = F.linear(x[rows], w_gate_up[e]).float()
        h = (act(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        y = F.linear(h, w_down[e]).float()
        y *= weights.reshape(-1)[order[rows], None]
        out.index_add_(0, token_of[rows], y)
        start += n
    return out.to(hidden.dtype)
