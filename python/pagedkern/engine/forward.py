"""A batch's forward pass with its failures pinned on the requests that caused them: when the
batch fails, each request runs alone to find who is at fault (rewriting the same K/V slots and
redrawing the same seeded samples is harmless), so one bad request does not fail its
neighbours. Errors nobody can be blamed for (a tensor-parallel rank gone, strict shadow mode)
are raised, not retried."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from .. import ops
from ..ops.shadow import ShadowDivergence, ShadowReport
from ..parallel import TensorParallelError

if TYPE_CHECKING:
    from .request import Request
    from .runner import ModelRunner, StepResult
    from .speculative import Proposal

log = logging.getLogger("pagedkern.engine")


class IsolatingForward:
    """Runs batches on `runner` under the engine's op backend (and shadow checks)."""

    def __init__(self, runner: ModelRunner, backend: str, shadow: ShadowReport | None):
        self.runner = runner
        self.backend = backend
        self.shadow = shadow

    def __call__(
        self,
        entries: list[tuple[Request, int]],
        forks: dict[Request, list[Request]] | None,
        proposals: dict[Request, Proposal] | None,
        iteration: int,
    ) -> tuple[list[StepResult], list[tuple[Request, Exception]]]:
        """The batch's StepResult (one per request run alone after a failure), and (request,
        error) for those that failed."""
        with ops.use_backend(self.backend), self._shadowed(iteration):
            try:
                return [self._run(entries, forks, proposals)], []
            except (TensorParallelError, ShadowDivergence):
                raise  # not a request's fault (ranks out of step; strict shadow): no retries
            except Exception as exc:  # noqa: BLE001 - isolated below
                if len(entries) == 1:
                    return [], [(entries[0][0], exc)]
                log.warning("a batch of %d failed (%r); retrying each alone", len(entries), exc)
            results, failures = [], []
            for entry in entries:
                try:
                    results.append(self._run([entry], forks, proposals))
                except Exception as exc:  # noqa: BLE001 - this request's fault
                    failures.append((entry[0], exc))
            return results, failures

    def _shadowed(self, iteration: int):
        """Shadow mode: this step's op calls are checked against their references."""
        if self.shadow is None:
            return contextlib.nullcontext()
        return self.shadow.active(iteration)

    def _run(self, entries, forks, proposals) -> StepResult:
        """runner.run, given `proposals` only in a speculative step (a plain step's call is the
        two-argument one that tests substitute)."""
        if not proposals:
            return self.runner.run(entries, forks)
        mine = {entry[0]: proposals[entry[0]] for entry in entries if entry[0] in proposals}
        return self.runner.run(entries, forks, mine)
