"""StepExecutor: one scheduled batch run to its appended outputs (Engine.step's second half).

Synchronously: speculation's proposals, the isolated forward pass and sampling, the step's
accounting (Scheduler.on_step_done, speculation's counts), the n > 1 forks, and the sampled
tokens appended (OutputProcessor). With async_scheduling (`Overlap`) a batch is launched behind
the step in flight, which is then completed; a batch that may not overlap runs synchronously
once that step is done. The executor holds no request state of its own: the requests are the
OutputProcessor's, the blocks the Scheduler's.
"""

from __future__ import annotations

from ..model import KVCache
from .forward import IsolatingForward
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .overlap import InFlight, Overlap
from .request import Request, RequestStatus
from .scheduler import ScheduledBatch, Scheduler
from .speculative.speculation import Speculation


class StepExecutor:
    def __init__(
        self,
        forward: IsolatingForward,
        scheduler: Scheduler,
        output: OutputProcessor,
        speculation: Speculation,
        proposer,
        overlap: Overlap | None,
        kv_cache: KVCache,
    ):
        self.forward, self.scheduler, self.output = forward, scheduler, output
        self.speculation, self.proposer, self.overlap = speculation, proposer, overlap
        self.kv_cache = kv_cache

    def run(self, batch: ScheduledBatch, iteration: int, outputs: list[RequestOutput]) -> None:
        """Run `batch` (with async_scheduling: launch it and complete the step before)."""
        if self.overlap is not None:
            self._step_overlapped(batch, iteration, outputs)
        elif batch:
            self._run(batch, iteration, outputs)

    def drain(self, outputs: list[RequestOutput]) -> None:
        """Complete the step in flight, if any."""
        previous = None if self.overlap is None else self.overlap.take()
        if previous is not None:
            self._complete(previous, outputs)

    def _run(self, batch: ScheduledBatch, iteration: int, outputs: list[RequestOutput]) -> None:
        """A synchronous step: propose, run the model, account the step, append."""
        output = self.output
        proposals = self.speculation.propose(self.proposer, batch) if batch.lookahead else {}
        if output.tracer:
            output.tracer.iteration(iteration, batch, self.scheduler.pool)
        forking = output.forking
        forks = {r: r.forks for r, _ in batch.entries if r in forking} if forking else {}
        results, failures = self.forward(batch.entries, forks, proposals, iteration)
        if failures:
            outputs += [output.fail(request, exc) for request, exc in failures]
            failed = {request for request, _ in failures}
            done = ScheduledBatch([e for e in batch.entries if e[0] not in failed])
        else:
            done = ScheduledBatch(batch.entries)
        if batch.lookahead:
            # what each request gained: a verified run ends in its recovered or bonus token
            gains = {r: (t,) for res in results for r, t in zip(res.requests, res.token_ids)}
            gains |= {r: tokens for res in results for r, tokens in res.verified}
            done.accepted = {r: tuple(gains[r][:-1]) for r in batch.lookahead if r in gains}
        tables = {r: len(r.block_table) for r in done.accepted}
        self.scheduler.on_step_done(done)  # the runner sampled exactly the requests it returns
        for request, accepted in done.accepted.items():
            proposal = proposals.get(request)
            self.speculation.count(request, proposal, accepted, tables[request], output.tracer)
        outputs += [output.fail(request, exc) for request, exc in done.failed]
        if forks:  # n > 1: prompts that completed now give their blocks to the other samples
            sampled = {request for result in results for request in result.requests}
            for leader in sampled & forks.keys():
                if leader.request_id in output.requests:  # not failed meanwhile
                    self._fork(leader, output.take_forks(leader))
        output.append(results, outputs)

    def _step_overlapped(
        self, batch: ScheduledBatch, iteration: int, outputs: list[RequestOutput]
    ) -> None:
        """async_scheduling: launch `batch` behind the step in flight, then complete that one;
        a batch that may not overlap runs synchronously once the step in flight is done."""
        overlap, tracer = self.overlap, self.output.tracer
        previous = overlap.take()
        if overlap.overlappable(batch):
            if tracer:
                tracer.iteration(iteration, batch, self.scheduler.pool)
            if overlap.launch(batch, previous, own_logits=tracer is not None):
                if previous is not None:
                    self._complete(previous, outputs)
                return
        if previous is not None and not self._complete(previous, outputs):
            return  # rolled back: the next step (synchronous) schedules afresh
        batch.entries = [e for e in batch.entries if e[0].status is RequestStatus.RUNNING]
        if not batch:  # minus those that ended with the step before
            return
        if previous is None:
            self._run(batch, iteration, outputs)
            return
        # A second append in this step: a request that already has an output in it gets its
        # plain token as an output too, not a TokenDeltas column. The engine core sends a
        # step's columns with its outputs and the client applies the columns first: the
        # column would run ahead of that earlier output.
        output = self.output
        output.had_output = {out.request_id for out in outputs}
        try:
            self._run(batch, iteration, outputs)
        finally:
            output.had_output = ()

    def _complete(self, step: InFlight, outputs: list[RequestOutput]) -> bool:
        """Wait for an overlapped step and append its ids; False: it failed (rolled back)."""
        result, failures = self.overlap.complete(step)
        outputs += [self.output.fail(request, exc) for request, exc in failures]
        if result is not None:
            self.output.append([result], outputs)
        return result is not None

    def _fork(self, leader: Request, samples: list[Request]) -> None:
        """n > 1: the further samples take the first's prompt KV (Scheduler.fork); the K/V of
        a partial last block is copied into each sample's own block. With prompt_logprobs each
        sample gets the first's table: a forked sample never computes its prompt itself."""
        data = self.kv_cache.data
        table = leader.logits_state.prompt_logprobs if leader.logits_state else None
        for sample in samples:
            if table is not None and sample.logits_state is not None:
                sample.logits_state.prompt_logprobs = list(table)
            copy = self.scheduler.fork(leader, sample)
            if copy is not None:
                data[:, :, copy[1]] = data[:, :, copy[0]]
