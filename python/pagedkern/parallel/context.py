"""The model's tensor-parallel hook (model/collectives.py) over torch.distributed: the sum of a
row-parallel output, the gather of the LM head's vocabulary shards to rank 0, and (expert
parallel) a MoE layer's dispatch and combine. The process
group itself (joining, workers, broadcasting steps, failures) is TPGroup in group.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.collectives import SINGLE, Collectives

__all__ = ["SINGLE", "TPContext"]


@dataclass
class TPContext(Collectives):
    rank: int = 0
    size: int = 1
    vocab_size: int = 0  # the full vocabulary (0 at size 1: unused)
    exit_on_failure: bool = False  # TPGroup: exit the process once a rank's failure is answered
    expert_parallel: bool = False  # MoE layers: whole experts per rank (expert_parallel.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (identity at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def routed_experts(self, hidden, router_logits, w_gate_up, w_down, top_k: int, **moe):
        """This rank's share of the routed experts' output (expert_parallel.py), all-reduced by
        the caller."""
        from .expert_parallel import replicated_tokens_moe

        return replicated_tokens_moe(hidden, router_logits, w_gate_up, w_down, top_k, **moe)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab_shard-or-less] fp32 logits of this rank's vocabulary rows -> the full
        [N, vocab] on rank 0, None on the other ranks (they never sample)."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        shard = self.vocab_shard
        if local.shape[1] < shard:  # the last rank's short shard: pad to the common width
            local = torch.nn.functional.pad(local, (0, shard - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=1)[:, : self.vocab_size]
