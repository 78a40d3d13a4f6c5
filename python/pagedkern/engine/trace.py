"""Hooks through which the engine narrates a request's life (`pagedkern-serve --trace`).
The engine calls these at each stage; serving/core/trace.py prints them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..model import Tokenizer
    from .block_pool import BlockPool
    from .request import Request
    from .scheduler import ScheduledBatch


class Tracer(Protocol):
    def request_added(self, request: Request) -> None: ...

    def iteration(self, number: int, batch: ScheduledBatch, pool: BlockPool) -> None: ...

    def candidates(
        self, request: Request, logits: torch.Tensor, token: int, tokenizer: Tokenizer
    ) -> None: ...

    def token(self, request: Request, token: int, text: str) -> None: ...

    def speculated(
        self,
        request: Request,
        proposed: tuple[int, ...],
        accepted: tuple[int, ...],
        slots_rewound: int,
        blocks_freed: int,
    ) -> None: ...

    def finished(self, request: Request, text: str, freed: list[int], pool: BlockPool) -> None: ...
