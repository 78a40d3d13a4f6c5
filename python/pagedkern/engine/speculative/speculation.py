"""The engine's side of speculative decoding in a step: the proposals for the requests the
scheduler gave lookahead slots (`propose`), and the acceptance counts and trace line of each
verified request (`count`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ... import ops
from .proposer import Proposal, Proposer

if TYPE_CHECKING:
    from ..request import Request
    from ..scheduler import ScheduledBatch
    from ..trace import Tracer

log = logging.getLogger("pagedkern.engine")


class Speculation:
    """Proposals per step and the counts EngineStats reports."""

    def __init__(self, name: str, backend: str):
        self.name = name  # config.speculative (for the log)
        self.backend = backend
        self.num_steps = self.num_proposed = self.num_accepted = 0

    def propose(self, proposer: Proposer, batch: ScheduledBatch) -> dict[Request, Proposal]:
        """Proposals for the requests that hold lookahead slots; each entry shrinks to 1 + the
        proposal's length (the slots past it are given back after the step). A failing
        proposer costs only the speedup: those requests decode as usual this step."""
        requests = list(batch.lookahead)
        try:
            with ops.use_backend(self.backend):
                made = proposer.propose(requests, [batch.lookahead[r] for r in requests])
        except Exception:  # noqa: BLE001 - speculation is an optimisation: decode instead
            log.exception("the %s proposer failed; decoding without it", self.name)
            for request in requests:
                proposer.forget(request)
            made = [Proposal(())] * len(requests)
        proposals = {r: p for r, p in zip(requests, made, strict=True) if p.token_ids}
        for r, p in proposals.items():  # a proposer past its slots: keep what fits
            k = batch.lookahead[r]
            if len(p.token_ids) > k:
                log.warning("%s: %d proposals for %d slots", r.request_id, len(p.token_ids), k)
                q = None if p.draft_probs is None else p.draft_probs[:k]
                proposals[r] = Proposal(p.token_ids[:k], q)
        batch.entries = [
            (r, 1 + len(proposals[r].token_ids) if r in proposals else 1)
            if r in batch.lookahead
            else (r, n)
            for r, n in batch.entries
        ]
        return proposals

    def count(
        self,
        request: Request,
        proposal: Proposal | None,
        accepted: tuple,
        table: int,
        tracer: Tracer | None,
    ) -> None:
        """Stats and the trace line of one verified request (table: its block count before
        the rejected tokens' slots were given back)."""
        proposed = () if proposal is None else proposal.token_ids
        if not proposed:
            return
        self.num_steps += 1
        self.num_proposed += len(proposed)
        self.num_accepted += len(accepted)
        if tracer:
            freed = table - len(request.block_table)
            tracer.speculated(request, proposed, accepted, len(proposed) - len(accepted), freed)
