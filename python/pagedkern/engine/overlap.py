"""Asynchronous (overlap) scheduling, EngineConfig.async_scheduling: while step N runs on the
engine's one worker thread, the engine thread schedules step N+1, lays it out and builds its
sampling inputs; then it waits for N's ids and appends them (stop checks, outputs, frees).

What runs where: the engine thread owns every request, the scheduler and the pool; the worker
(`StepWorker`, one thread, steps strictly in order) runs ModelRunner.execute: placeholder fill,
upload, forward, sampling, ids back to the host. It reads only the PreparedStep (a snapshot
made by ModelRunner.prepare), so the engine thread may change block tables meanwhile; every
write to the KV cache happens on the worker in step order, so a block freed while a step that
writes it is in flight is only reused by later steps, whose writes come after.

Placeholders: a request sampled in N that runs again in N+1 has that token pending
(Request.num_pending, counted by num_tokens: budget, slots and sampling offset are all known
without it). Its N+1 row is a placeholder the worker fills from N's sampled ids before the
forward (on the host side of the upload, so a CUDA-graph replay sees it too). The scheduler
accounts a step's tokens as computed at launch (Scheduler.on_step_launched), hashes blocks that
fill once the step is complete (register_computed), never schedules past max_tokens or the
context, and admits no preempted request whose token is still in flight.

Stops resolve one step late: a request that ends at N (EOS, stop id or string, grammar, abort,
timeout) has its N+1 token discarded; its blocks went back when it finished. A preempted
request's in-flight token is appended when N completes, as a synchronous step would have.

Buffers: a step's host inputs are its own (the layout's packed array, copied sampling
columns; the static graph buffers are rewritten only by the next step on the worker, after
this one's ids were read back), and the logits a tracer reads are a copy: a graph replay
returns its static output, which the next step overwrites before the engine thread traces.

Synchronous steps: a step whose batch holds a request whose next step needs host state from
its last token (Request.needs_sync: penalties, multi-token bad words, min_tokens, grammar,
prompt logprobs) or an n > 1 fork (its KV copy) first completes the step in flight, then runs
as without overlap. Speculative decoding and tensor parallelism are refused with it
(EngineConfig).

Failures: a launch that fails (layout) falls back to a synchronous step. A step that fails on
the worker (the one after it fails with it) is rolled back (computed tokens and pending counts
of both) and the next step runs synchronously, where the engine's per-request isolation pins
the failure on whoever caused it.

The engine drives it through four calls: `take` (detach the step in flight), `overlappable`,
`launch` (hand a batch to the worker) and `complete` (wait for a step's ids); it appends the
ids itself, as after a synchronous step. `Overlap` knows the runner and the scheduler, not the
engine.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .. import ops
from .request import Request, RequestStatus
from .runner import ModelRunner, PreparedStep, StepResult
from .scheduler import ScheduledBatch, Scheduler

log = logging.getLogger("pagedkern.engine")


@dataclass(slots=True, eq=False)
class InFlight:
    """A step handed to the worker and not yet completed. advanced: (request, computed tokens
    before, after) per entry; rows: the requests it samples -> their row in its ids (each
    holds one pending token until the step completes or is abandoned)."""

    batch: ScheduledBatch
    future: Future[StepResult]
    advanced: list[tuple[Request, int, int]]
    rows: dict[Request, int]


class StepWorker:
    """The one thread that runs steps, in submission order."""

    def __init__(self, runner: ModelRunner, backend: str):
        self.runner = runner
        self.backend = backend
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedkern-step")

    def submit(self, step: PreparedStep, previous: InFlight | None) -> Future[StepResult]:
        before = previous.future if previous is not None and step.fill_rows else None
        return self._executor.submit(self._run, step, before)

    def _run(self, step: PreparedStep, before: Future[StepResult] | None) -> StepResult:
        # `before` ran first on this thread: done (its failure fails this step too)
        previous = None if before is None else before.result()
        with ops.use_backend(self.backend):  # a context variable: set on this thread
            return self.runner.execute(step, previous)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class Overlap:
    """The engine's overlapped steps: the worker, the step in flight and its bookkeeping."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, backend: str):
        self.runner = runner
        self.scheduler = scheduler
        self.worker = StepWorker(runner, backend)
        self.in_flight: InFlight | None = None
        self.sync_next = False  # after a failed step: one synchronous step isolates it
        self.num_overlapped = 0  # steps launched while another was in flight (tests, bench)

    def take(self) -> InFlight | None:
        """The step in flight, detached (the caller completes it, or drops it)."""
        step, self.in_flight = self.in_flight, None
        return step

    def overlappable(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` may run behind the step in flight; False (the synchronous path)
        also for the one step after a failure."""
        if self.sync_next or not batch:
            self.sync_next = False
            return False
        return not any(r.needs_sync or r.forks for r, _ in batch.entries)

    def launch(
        self, batch: ScheduledBatch, previous: InFlight | None, own_logits: bool = False
    ) -> InFlight | None:
        """Hand `batch` to the worker behind `previous` (whose sampled ids fill its
        placeholders); it becomes the step in flight. None: the launch failed (the caller runs
        the batch synchronously). own_logits: copy the logits (a tracer reads them late)."""
        try:
            pending = {} if previous is None else previous.rows
            step = self.runner.prepare(batch.entries, pending=pending)
            step.own_logits = own_logits
            future = self.worker.submit(step, previous)
            advanced = self.scheduler.on_step_launched(batch)
            requests, _ = step.sample_requests()
        except Exception:  # noqa: BLE001 - e.g. a bad layout: the synchronous path isolates it
            log.warning(
                "launching an overlapped step failed; running it synchronously", exc_info=True
            )
            return None
        for request in requests:
            request.num_pending += 1
        self.in_flight = InFlight(batch, future, advanced, {r: j for j, r in enumerate(requests)})
        self.num_overlapped += previous is not None
        return self.in_flight

    def complete(self, step: InFlight) -> tuple[StepResult | None, list[tuple[Request, Exception]]]:
        """Wait for the step's ids: its StepResult (to append) and the requests whose own
        block hashing failed; None when the step failed and was rolled back with the step
        after it (the next step runs synchronously)."""
        try:
            result = step.future.result()
        except Exception as exc:  # noqa: BLE001 - isolated by the synchronous rerun
            log.warning("an overlapped step failed (%r); rerunning it synchronously", exc)
            if self.in_flight is not None:  # it needs this step's ids: it failed too
                self._abandon(self.in_flight)
                self.in_flight = None
            self._abandon(step)
            self.sync_next = True
            return None, []
        for request in step.rows:
            request.num_pending -= 1
        failures = []
        for request, before, after in step.advanced:
            if request.status is RequestStatus.RUNNING:  # not ended or preempted meanwhile
                try:
                    self.scheduler.register_computed(request, before, after)
                except Exception as exc:  # noqa: BLE001 - its own hashing: it fails alone
                    failures.append((request, exc))
        return result, failures

    def close(self) -> None:
        self.worker.close()

    @staticmethod
    def _abandon(step: InFlight) -> None:
        """Undo a launched step's accounting (newest step first): its tokens are not computed
        after all, its pending tokens never come."""
        for request in step.rows:
            request.num_pending -= 1
        for request, before, _ in step.advanced:
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens = before
