"""Expert parallelism for MoE layers: rank r of N holds experts expert_range(E, r, N) whole
(model/tensor_shard.py: E // N each, the first E % N ranks one more). One layer, for the tokens a
rank owns (expert_parallel_moe):

  1. route on the owner (router replicated): each token's top-k (expert id, weight) pairs;
  2. dispatch: the pairs sorted by the rank owning their expert; counts exchanged with one
     all_to_all_single of N ints (the splits are host lists: one sync per layer), then the
     token rows and their expert ids with all_to_all_single over those splits;
  3. each rank runs ops.fused_moe over its experts, one expert per received row (top-1 of
     one-hot logits: weight exactly 1), with the experts' biases and activation;
  4. combine: the rows go back by the reverse all_to_all_single (splits swapped), and the owner
     sums them weighted by its routing weights, in fp32.

In the engine (replicated_tokens_moe) every rank of the tensor-parallel group holds the same T
tokens after attention's all-reduce, so each rank owns a contiguous 1/N of them (a rank may own
none), runs the layer above for those, and writes its rows into a zero [T, H] that the model's
all-reduce after the MLP (the one tensor parallelism needs anyway) completes. Every (token,
expert) pair is computed once in the group, and each rank reads only its experts' weights.
vLLM at data-parallel size 1 computes all T tokens on every rank through its own experts
(expert_map) and all-reduces instead: no all-to-all, but every rank routes every token.

Under CUDA graphs the host splits would need a fixed per-rank capacity (graphs are off under
tensor parallelism today).
"""

from __future__ import annotations

import torch

from .. import ops
from ..model.tensor_shard import expert_range
from ..ops.moe import moe_route

_NOT_CHOSEN = -1e4  # a one-hot logit's others: exp(-1e4) is 0 in fp32, so the weight is 1


def expert_parallel_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up,
    w_down,
    top_k: int,
    *,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    group=None,
    **activation_args,
) -> torch.Tensor:
    """[T, H] MoE output of this rank's tokens hidden [T, H] (T may be 0) with router_logits
    [T, E] over all E experts, of which this rank holds expert_range(E, rank, N)'s: w_gate_up
    [E_r, 2I, H] and w_down [E_r, H, I] (float or stacked QuantizedWeights) and their optional
    biases [E_r, 2I] / [E_r, H]; activation_args: ops.fused_moe's swiglu_alpha / swiglu_limit.
    Every rank of `group` calls it for the same layer."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    num_experts = router_logits.shape[1]
    bounds = [expert_range(num_experts, r, size).start for r in range(size)]
    local = expert_range(num_experts, rank, size)
    if w_gate_up.shape[0] != len(local):
        raise ValueError(
            f"router_logits {tuple(router_logits.shape)}: rank {rank} of {size} holds experts "
            f"[{local.start}, {local.stop}), but w_gate_up has {w_gate_up.shape[0]}"
        )
    tokens, h = hidden.shape
    device = hidden.device
    if tokens:
        weights, ids = moe_route(router_logits, top_k, renormalize=renormalize, scoring=scoring)
        weights, ids = weights.flatten(), ids.long().flatten()
    else:  # (a rank that owns no token still joins every exchange)
        weights = torch.empty(0, dtype=torch.float32, device=device)
        ids = torch.empty(0, dtype=torch.long, device=device)
    owner = torch.arange(tokens, device=device).repeat_interleave(top_k)
    dest = torch.bucketize(ids, torch.tensor(bounds[1:], device=device), right=True)
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()

    rows = hidden.new_empty(sum(recv_splits), h)
    dist.all_to_all_single(rows, hidden[owner[order]].contiguous(), recv_splits, send_splits,
                           group=group)  # fmt: skip
    experts = torch.empty(sum(recv_splits), dtype=torch.long, device=device)
    dist.all_to_all_single(experts, ids[order].contiguous(), recv_splits, send_splits,
                           group=group)  # fmt: skip
    experts -= local.start  # (ids arrive global)

    out_rows = hidden.new_empty(len(rows), h)
    if len(rows):
        one_hot = torch.full((len(rows), len(local)), _NOT_CHOSEN, device=device)
        one_hot.scatter_(1, experts[:, None], 0.0)
        out_rows = ops.fused_moe(
            rows, one_hot, w_gate_up, w_down, 1, activation=activation,
            w_gate_up_bias=w_gate_up_bias, w_down_bias=w_down_bias, **activation_args,
        )  # fmt: skip
    back = hidden.new_empty(len(ids), h)
    dist.all_to_all_single(back, out_rows.contiguous(), send_splits, recv_splits, group=group)

    out = torch.zeros(tokens, h, dtype=torch.float32, device=device)
    out.index_add_(0, owner[order], back.float() * weights[order][:, None])
    return out.to(hidden.dtype)


def token_slice(tokens: int, rank: int, size: int) -> slice:
    """The rows of T replicated tokens rank `rank` of `size` owns: contiguous ceil(T/N) each
    (the last ranks may own fewer, or none)."""
    per = -(-tokens // size)
    return slice(min(tokens, rank * per), min(tokens, (rank + 1) * per))


def replicated_tokens_moe(
    hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up, w_down, top_k: int, **moe
) -> torch.Tensor:
    """[T, H]: this rank's share of the routed experts' output for hidden [T, H] and
    router_logits [T, E] (the same on every rank): its token_slice's rows, zeros elsewhere, so
    that the sum over the ranks (the caller's all-reduce) is the layer's output. `moe`:
    expert_parallel_moe's keywords."""
    import torch.distributed as dist

    own = token_slice(hidden.shape[0], dist.get_rank(), dist.get_world_size())
    mine = expert_parallel_moe(hidden[own], router_logits[own], w_gate_up, w_down, top_k, **moe)
    out = torch.zeros_like(hidden)
    out[own] = mine
    return out
