"""What the engine asks of a proposer (n-gram lookup, a draft model): up to k next tokens per
request, and the distribution each was drawn from (None: a point mass, as n-gram lookup is)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..request import Request


@dataclass(frozen=True, slots=True)
class Proposal:
    """token_ids: 0..k proposed continuations of the request's prompt + output. draft_probs:
    float32 [len(token_ids), V], row j the distribution token_ids[j] was drawn from (what the
    rejection rule divides by), or None for a point mass."""

    token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Proposal]:
        """One proposal of at most max_tokens[i] tokens for requests[i], each of which is
        decoding (its prompt is computed) and already holds KV slots for num_tokens +
        max_tokens[i] tokens in its block table (a draft model writes its own cache at the same
        slots). Proposing nothing is always allowed and must be cheap."""
        ...

    def forget(self, request: Request) -> None:
        """The request finished, was aborted or preempted (its blocks are gone): drop any
        per-request state, such as how much of it a draft model's cache holds."""
        ...
