"""Mixture-of-experts MLP: the router (softmax over experts, top-k, optional renormalisation;
or gpt-oss's softmax over the top-k logits) and the experts' gated MLPs applied to the tokens
routed to them, combined by routing weight.

Operands: hidden [T, H]; router_logits [T, E]; w_gate_up [E, 2I, H] (each expert's gate rows
then up rows, the halves silu_and_mul expects); w_down [E, H, I]; optional expert biases
[E, 2I] and [E, H] (gpt-oss). Tokens are grouped by expert with one sort (no loop over
tokens); the loop runs over the experts that received tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


SCORINGS = ("softmax", "sigmoid", "softmax_topk")
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """gpt-oss's activation (transformers' GptOssExperts._apply_gate), in gate's dtype: gate
    clamped above at limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gated(activation: str, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """act(gate) * up of a [N, 2I] gate|up block (fp32 in, fp32 out)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if activation == "clamped_swiglu":
        return clamped_swiglu(gate, up, alpha, limit)
    return ACTIVATIONS[activation](gate) * up


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): each token's k experts with the
    largest scores, softmax over the E experts in fp32 (or a sigmoid per expert; or
    "softmax_topk": softmax over the k selected logits only, gpt-oss), divided by their sum if
    `renormalize` (Mixtral; Qwen's norm_topk_prob).

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
    elif scoring == "softmax_topk":
        weights = torch.softmax(logits.gather(-1, ids), dim=-1)
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
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """out[t] = sum over t's top-k experts e of weight[t, e] * down_e(act(gate_e(x)) * up_e(x)),
    [T, H] in hidden's dtype. The GEMMs run in hidden's dtype (as the dense MLP's do), each
    with its bias (if given) added before its one rounding, the activation in fp32 rounded
    once, the weighted sum in fp32 rounded once at the end. "clamped_swiglu": gpt-oss's
    (clamped_swiglu) with swiglu_alpha and swiglu_limit."""
    tokens, num_experts = hidden.shape[0], w_gate_up.shape[0]
    weights, ids = moe_route(router_logits, top_k, renormalize, scoring)
    order, counts = group_by_expert(ids, num_experts)
    token_of = order // top_k
    x = hidden[token_of]  # [T*k, H], grouped by expert
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
    start = 0
    for e, n in enumerate(counts.tolist()):  # (host sync: fine for the reference)
        if n == 0:
            continue
        rows = slice(start, start + n)
        bias = None if w_gate_up_bias is None else w_gate_up_bias[e]
        gate_up = F.linear(x[rows], w_gate_up[e], bias).float()
        h = gated(activation, gate_up, swiglu_alpha, swiglu_limit).to(hidden.dtype)
        bias = None if w_down_bias is None else w_down_bias[e]
        y = F.linear(h, w_down[e], bias).float()
        y *= weights.reshape(-1)[order[rows], None]
        out.index_add_(0, token_of[rows], y)
        start += n
    return out.to(hidden.dtype)
