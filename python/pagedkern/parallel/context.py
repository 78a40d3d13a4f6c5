"""What the model's forward needs to know about tensor parallelism: this rank, the group size,
the two collectives (all-reduce of a row-parallel output, gather of the LM head's vocab shards to
rank 0) and this rank's vocabulary rows. `SINGLE` (size 1) makes every hook an identity, so
model/llama.py has one forward for TP = 1 and TP = N."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TPContext:
    rank: int = 0
    size: int = 1
    vocab_size: int = 0  # the full vocabulary (0 at size 1: unused)
    exit_on_failure: bool = False  # TPGroup: exit the process once a rank's failure is answered

    @property
    def vocab_shard(self) -> int:
        """Rows of the embedding / LM head per rank (the last rank may hold fewer)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (identity at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

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

    def upload(self, layout, device: torch.device, logits: bool):
        """The step's input_ids and metadata on `device` (TP rank 0 also broadcasts them)."""
        return layout.upload(device)

    def fatal_errors(self) -> contextlib.AbstractContextManager:
        """Around a step's forward: at size 1 errors stay the request's (see TPGroup)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop the group's workers (nothing at size 1)."""


SINGLE = TPContext()
