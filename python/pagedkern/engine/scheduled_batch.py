"""One iteration's schedule: which requests run and how many tokens each feeds."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(slots=True)
class ScheduledBatch:
    """One iteration: (request, number of new tokens) in batch order, who was preempted, and
    the requests whose own scheduling or accounting failed (removed from the queues, blocks
    given back; the engine finishes them with an error). lookahead: decoding requests that may
    speculate and the k proposals they hold slots for (their entry counts 1 + k tokens until
    the engine shrinks it to 1 + the proposal's length). accepted: after verification, the
    proposals each accepted (they count as computed; the engine appends them to the output)."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    lookahead: dict[Request, int] = field(default_factory=dict)
    accepted: dict[Request, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def take_back(self, request: Request) -> int:
        """Take `request`'s entry out of the batch (it was preempted after being scheduled);
        the tokens it had."""
        for j, (r, num_new) in enumerate(self.entries):
            if r is request:
                del self.entries[j]
                self.lookahead.pop(request, None)
                return num_new
        return 0
