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


SCORINGS = ("softmax", "sigmoid")


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): each token's k experts with the
    largest scores, softmax over the E experts in fp32 (or a sigmoid per expert), divided by
    their sum if `renormalize` (Mixtral; Qwen's norm_topk_prob).

    Selection and ties: both scorings are monotone in the logit, so the k largest scores are the
    k largest fp32 logits; they are chosen on the logits (a stable descending sort: equal logits
    go to the lower expert id, in that order). The ids therefore never depend on how exp
    rounds, and the CUDA router (csrc/moe_route.cu) agrees with them exactly."""
    logits = router_logits.float()
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if scoring == "softmax":
        weights = torch.softmax(logits, dim=-1).gather(-1, ids)
    elif scoring == "sigmoid":
        weights = torch.sigmoid(logits.gather(-1, ids))
    else:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
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


def padded_rows(pairs: int, num_experts: int, tile_m: int) -> int:
    """Rows of align_by_expert's layout: every non-empty expert (at most min(E, pairs)) padded
    to a multiple of tile_m, rounded up to whole tiles. Fixed by the shapes alone."""
    bound = pairs + min(num_experts, pairs) * (tile_m - 1)
    return -(-bound // tile_m) * tile_m


def align_by_expert(
    ids: torch.Tensor, num_experts: int, tile_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [padded_rows] int32, tile_expert [padded_rows / tile_m] int32): the layout
    the grouped GEMM reads (csrc/moe.h moe_align). Pair i = t*k + slot; expert 0's pairs in
    increasing i, padded with the sentinel T*k to a multiple of tile_m, then expert 1's, ...,
    sentinels to the end; each tile's expert, -1 for the unused tiles."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    order, counts = group_by_expert(flat, num_experts)
    padded = (counts + tile_m - 1) // tile_m * tile_m
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - first[experts]
    rows = padded_rows(pairs, num_experts, tile_m)
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[starts[experts] + rank] = order.to(torch.int32)
    tile_expert = torch.full((rows // tile_m,), -1, dtype=torch.int32, device=flat.device)
    owners = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // tile_m
    )
    tile_expert[: owners.numel()] = owners.to(torch.int32)
    return sorted_pairs, tile_expert


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
) -> torch.Tensor:
    """out[t] = sum over t's top-k experts e of weight[t, e] * down_e(act(gate_e(x)) * up_e(x)),
    [T, H] in hidden's dtype. The GEMMs run in hidden's dtype (as the dense MLP's do), the
    activation in fp32 rounded once, the weighted sum in fp32 rounded once at the end."""
    tokens, num_experts = hidden.shape[0], w_gate_up.shape[0]
    inter = w_down.shape[-1]
    weights, ids = moe_route(router_logits, top_k, renormalize, scoring)
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
