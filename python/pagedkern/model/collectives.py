"""The model's tensor-parallel hook, as gpt-fast keeps it: the forward calls these where a
sharded model must talk to the other ranks (the sum of a row-parallel output, the LM head's
vocabulary shards gathered to rank 0, this rank's vocabulary rows), and the model knows nothing
else of parallelism. `SINGLE` is one rank: every hook an identity, so model/llama.py has one
forward for TP = 1 and TP = N. parallel/ supplies the implementation over torch.distributed
(parallel/context.py TPContext, parallel/group.py TPGroup)."""

from __future__ import annotations

import contextlib

import torch


class Collectives:
    rank: int = 0
    size: int = 1
    vocab_size: int = 0  # the full vocabulary (0 at size 1: unused)

    @property
    def vocab_shard(self) -> int:
        """Rows of the embedding / LM head per rank (the last rank may hold fewer)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        return x

    expert_parallel: bool = False  # MoE layers hold whole experts (routed_experts below)

    def routed_experts(self, hidden, router_logits, w_gate_up, w_down, top_k: int, **moe):
        """Expert parallel: this rank's share of the routed experts' output for hidden [T, H]
        (every rank's the same), which the caller's all-reduce completes; `moe`: the options of
        ops.fused_moe (model/moe.py). parallel/ implements it."""
        raise NotImplementedError("expert parallelism needs a process group (parallel/)")

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab_shard-or-less] fp32 logits of this rank's vocabulary rows -> the full
        [N, vocab] on rank 0, None on the other ranks (they never sample)."""
        return local

    def upload(self, layout, device: torch.device, logits: bool):
        """The step's input_ids and metadata on `device` (TP rank 0 also broadcasts them)."""
        return layout.upload(device)

    def fatal_errors(self) -> contextlib.AbstractContextManager:
        """Around a step's forward: at size 1 errors stay the request's."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop the group's workers (nothing at size 1)."""


SINGLE = Collectives()
