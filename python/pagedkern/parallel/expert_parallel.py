"""Expert parallelism for one MoE layer: rank r of N holds experts [r·E/N, (r+1)·E/N) whole, and
every rank its own tokens (data-parallel attention, as DeepSeek-style EP runs). The layer:

  1. route on the owner (router replicated): each token's top-k (expert id, weight) pairs;
  2. dispatch: the pairs sorted by the rank owning their expert; counts exchanged with one
     all_to_all_single of N ints (the splits are host lists: one sync per layer), then the
     token rows and their local expert ids with all_to_all_single over those splits;
  3. each rank runs ops.fused_moe over its experts, one expert per received row (top-1 of
     one-hot logits: weight exactly 1);
  4. combine: the rows go back by the reverse all_to_all_single (splits swapped), and the owner
     sums them weighted by its routing weights, in fp32.

Not wired into the engine yet (the loader would read whole experts per rank, TensorShard's
expert ranges); under CUDA graphs the host splits would need a fixed per-rank capacity.
"""

from __future__ import annotations

import torch

from .. import ops
from ..ops.moe import moe_route

_NOT_CHOSEN = -1e4  # a one-hot logit's others: exp(-1e4) is 0 in fp32, so the weight is 1


def expert_parallel_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
    group=None,
) -> torch.Tensor:
    """[T, H] MoE output of this rank's tokens hidden [T, H] with router_logits [T, E] over all
    E experts, of which this rank holds w_gate_up [E/N, 2I, H] and w_down [E/N, H, I] (its
    range of ids); every rank of `group` calls it for the same layer."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = w_gate_up.shape[0]
    if router_logits.shape[1] != local * size:
        raise ValueError(
            f"router_logits {tuple(router_logits.shape)}: {local} experts on each of {size} "
            f"ranks make {local * size}"
        )
    tokens, h = hidden.shape
    weights, ids = moe_route(router_logits, top_k, renormalize=renormalize, scoring=scoring)
    ids = ids.long().flatten()
    owner = torch.arange(tokens, device=hidden.device).repeat_interleave(top_k)
    order = torch.argsort(ids // local, stable=True)
    send = torch.bincount(ids // local, minlength=size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()

    rows = hidden.new_empty(sum(recv_splits), h)
    dist.all_to_all_single(rows, hidden[owner[order]].contiguous(), recv_splits, send_splits,
                           group=group)  # fmt: skip
    experts = torch.empty(sum(recv_splits), dtype=torch.long, device=hidden.device)
    dist.all_to_all_single(experts, ids[order].contiguous(), recv_splits, send_splits,
                           group=group)  # fmt: skip
    experts -= rank * local  # (ids arrive global: this rank's are [rank*local, (rank+1)*local))

    out_rows = hidden.new_empty(len(rows), h)
    if len(rows):
        one_hot = torch.full((len(rows), local), _NOT_CHOSEN, device=hidden.device)
        one_hot.scatter_(1, experts[:, None], 0.0)
        out_rows = ops.fused_moe(rows, one_hot, w_gate_up, w_down, 1, activation=activation)
    back = hidden.new_empty(len(ids), h)
    dist.all_to_all_single(back, out_rows.contiguous(), send_splits, recv_splits, group=group)

    out = torch.zeros(tokens, h, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, owner[order], back.float() * weights.flatten()[order][:, None])
    return out.to(hidden.dtype)
