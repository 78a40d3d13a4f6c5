"""The serving engine: requests in, token deltas out, many requests sharing each forward pass.

One `step()` is one iteration of the reference document's loop: expire timed-out requests,
schedule (decodes and prompt chunks under the token budget), run the model, sample, append,
detokenize, check every stop condition, free the KV blocks of finished requests.

With speculative decoding (config.speculative) a decoding request also gets k proposals
(engine/speculative/): its last token and the proposals run as 1 + k rows, verification keeps
the accepted prefix plus one recovered or bonus token, the rejected tokens' KV slots are
rewound (Scheduler.on_step_done), and the tokens gained are appended one by one with every stop
check, so a stop inside an accepted run drops the tokens after it.

With async_scheduling (engine/overlap.py) a step() launches the next batch on a worker thread
before it completes the one in flight: its outputs are those of the step before.

Bad input is refused at admission (ValueError naming the field). Should a step still fail, the
failure is pinned on the request(s) it can be attributed to (the scheduler isolates a request's
own hashing and accounting; a failed forward pass is retried request by request): those finish
with FinishReason.ERROR and their blocks go back; a failure nobody can be blamed for finishes
that step's requests. Either way the engine stays usable.

Engine is three files: this one (construction, the step loop, the forward pass and its
isolation), admission.py (add_request, abort, stream) and appending.py (append, stop checks,
finishing; the fast lane of plain decodes).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections.abc import Iterator

import torch

from .. import envs, ops
from .._extension import cuda_available, cuda_unavailable_reason
from ..model import LlamaModel, Tokenizer
from ..ops.shadow import ShadowDivergence, ShadowReport
from ..parallel import TensorParallelError
from .admission import Admission
from .appending import Appending
from .block_pool import BlockPool
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kernel_policy import decode_graphs, piecewise_graphs
from .kv_budget import allocate_kv_cache, kv_cache_blocks, release_device_memory
from .outputs import EngineStats, RequestOutput, TokenDeltas
from .overlap import Overlap
from .request import FinishReason, Request
from .runner import ModelRunner, StepResult
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from .speculative import Proposal, load_draft, make_proposer
from .trace import Tracer

log = logging.getLogger("pagedkern.engine")


def pick_device(backend: str) -> torch.device:
    """The device a backend runs on; "cuda" without a usable GPU is an error that says why."""
    gpu = torch.cuda.is_available()
    if backend == "cuda" and not (gpu and cuda_available()):
        reason = cuda_unavailable_reason() or "torch sees no CUDA device"
        raise RuntimeError(f"--backend cuda needs a GPU and the kernels: {reason}")
    if backend == "auto" and gpu and not cuda_available():
        return torch.device("cpu")  # a GPU without our kernels: stay on the CPU reference
    return torch.device("cuda" if gpu else "cpu")


class Engine(Admission, Appending):
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig,
        tracer: Tracer | None = None,
    ):
        self.model = model
        self.owns_model = False  # from_config loaded it: close() frees its weights
        self.tokenizer = tokenizer
        self.config = config
        self.tracer = tracer
        # The op backend is this engine's setting, applied around its own forward passes (a
        # context variable), never flipped for the whole process.
        self.backend = config.backend
        self.vocab_size = model.config.vocab_size
        context = min(config.max_model_len or model.max_positions, model.max_positions)
        # On by default where the kernels run on a GPU; refused or off (with a warning) where a
        # kernel does not cover this model and cache (engine/kernel_policy.py).
        graphs = decode_graphs(
            device_type=model.device.type,
            backend=self.backend,
            dtype=str(model.dtype).removeprefix("torch."),
            head_dim=model.config.head_dim,
            block_size=config.block_size,
            vocab=model.config.vocab_size,
            requested=config.cuda_graphs,
            kv_cache_dtype=model.kv_cache_dtype,
        )
        graphs = graphs and model.tp.size == 1  # TP steps broadcast and all-reduce: no graphs
        # shadow mode checks each op call on the host: every step runs eagerly, through ops
        shadow = config.shadow or envs.get("PAGEDKERN_SHADOW")
        self.shadow = None if shadow == "off" else ShadowReport(shadow == "strict")
        if self.shadow is not None:
            graphs = False
            model.fast_cpu_decode = False
        piecewise = piecewise_graphs(decode_graphs=graphs, requested=config.piecewise_cuda_graphs)
        self.broken: TensorParallelError | None = None  # the TP group failed: nothing runs
        with ops.use_backend(self.backend):  # the profiling pass and graph capture run ops
            draft = load_draft(config, model)  # its weights and KV cache count in the budget
            num_blocks = config.num_blocks or kv_cache_blocks(
                model, config, context, None if draft is None else draft[0]
            )
            # A sequence can never outgrow the whole cache: one that did would be preempted
            # forever.
            self.max_model_len = min(context, num_blocks * config.block_size)
            if model.tp.size > 1:  # the workers allocate their shares of the same blocks
                model.tp.share_cache_shape(num_blocks, config.block_size)
            self.kv_cache = allocate_kv_cache(model, num_blocks, config.block_size)
            self.runner = ModelRunner(
                model,
                self.kv_cache,
                config.max_num_seqs,
                self.max_model_len,
                cuda_graphs=graphs,
                piecewise_tokens=config.max_num_batched_tokens if piecewise else None,
            )
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        # async_scheduling: steps run on a worker thread, the next scheduled meanwhile
        self.overlap = Overlap(self) if config.async_scheduling else None
        self.scheduler = Scheduler(
            self.pool, SchedulerConfig.from_engine(config, self.max_model_len)
        )
        with ops.use_backend(self.backend):
            self.proposer = make_proposer(config, self.kv_cache, draft)
        self._spec_steps = self._spec_proposed = self._spec_accepted = 0
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # False: outputs carry token ids only, no text (the HTTP front end detokenizes; stop
        # strings are then refused)
        self.detokenize = True
        # the HTTP core: plain decode tokens as two columns instead of RequestOutputs
        self.token_deltas: TokenDeltas | None = None
        self._stop_ids: dict[str, frozenset[int]] = {}  # ids that end the request (EOS too)
        self._timed: dict[str, Request] = {}  # those with a timeout: the only ones step() scans
        self._undelivered: list[RequestOutput] = []  # taken by stream() for other requests
        # n > 1: samples waiting for their first request's prompt (they fork from its blocks)
        self._forks: dict[Request, list[Request]] = {}
        self._ids = itertools.count()
        self._seeds = random.Random()
        self.iteration = 0
        self._num_prompt_tokens = self._num_generated_tokens = self._num_finished = 0
        self.clock = time.monotonic  # arrival, token and finish times; tests substitute it

    @classmethod
    def from_config(cls, config: EngineConfig, tracer: Tracer | None = None) -> Engine:
        device = torch.device(config.device) if config.device else pick_device(config.backend)
        model, tokenizer = config.model_spec().load(device)
        if config.tensor_parallel_size > 1:
            from ..parallel.engine_group import start_tensor_parallel

            model = start_tensor_parallel(model, config)  # rank 0's shard, workers started
        engine = cls(model, tokenizer, config, tracer)
        engine.owns_model = True
        return engine

    def describe(self) -> str:
        """The model line of --trace / --stats, with the KV cache's size."""
        kv = self.kv_cache.data
        return f"{self.model.describe()}, {kv.numel() * kv.element_size() / 2**20:.0f} MiB KV"

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (call it where the engine runs: it is not
        thread-safe)."""
        scheduler, pool = self.scheduler, self.pool
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.num_used,
            num_blocks_free=pool.num_free,
            block_size=pool.block_size,
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_finished=self._num_finished,
            num_iterations=self.iteration,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            speculative=self.config.speculative,
            num_spec_steps=self._spec_steps,
            num_spec_proposed=self._spec_proposed,
            num_spec_accepted=self._spec_accepted,
        )

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; the outputs it produced (and any that `stream()` set aside for
        requests other than its own). Never raises for a request's fault; raises
        TensorParallelError once a broken TP group has failed every request."""
        if self.broken is not None:
            raise self.broken
        outputs, self._undelivered = self._undelivered, []
        if self._timed:
            now = self.clock()
            outputs += [
                self._finish(r, FinishReason.TIMEOUT)
                for r in list(self._timed.values())
                if now - r.arrival_time > r.params.timeout
            ]
        try:
            batch = self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001 - the scheduler's own fault: fail who it holds
            self._fail_all(list(self.scheduler.running), exc, outputs)
            if self.overlap is not None:
                self.overlap.drain(outputs)
            return outputs
        outputs += [self._fail(request, exc) for request, exc in batch.failed]
        if self.proposer is not None:
            for victim in batch.preempted:
                self.proposer.forget(victim)
        if self.overlap is not None:
            self._step_overlapped(batch, outputs)
            return outputs
        if not batch:
            return outputs
        self.iteration += 1
        try:
            self._run(batch, outputs)
        except TensorParallelError as exc:  # a rank is gone: nobody can be served any more
            self.broken = exc
            self._fail_all(list(self.requests.values()), exc, outputs)
        except ShadowDivergence as exc:  # strict shadow mode: stop with the report
            self._fail_all([request for request, _ in batch.entries], exc, outputs)
            raise
        except Exception as exc:  # noqa: BLE001 - not one request's fault: this step's fail
            self._fail_all([request for request, _ in batch.entries], exc, outputs)
        return outputs

    def _step_overlapped(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        """async_scheduling: launch `batch`, then complete the step in flight
        (engine/overlap.py); a failure nobody can be blamed for fails both steps' requests."""
        self.iteration += bool(batch)
        try:
            self.overlap.step(batch, outputs)
        except Exception as exc:  # noqa: BLE001 - not one request's fault: these steps' fail
            self.overlap.in_flight = None  # with any token still pending: nothing will come
            stranded = [r for r in self.requests.values() if r.num_pending]
            self._fail_all([request for request, _ in batch.entries] + stranded, exc, outputs)

    def _run(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        proposals = self._propose(batch)
        if self.tracer:
            self.tracer.iteration(self.iteration, batch, self.pool)
        waiting = self._forks
        forks = {r: waiting[r] for r, _ in batch.entries if r in waiting} if waiting else {}
        results, failures = self._forward(batch.entries, forks, proposals)
        if failures:
            outputs += [self._fail(request, exc) for request, exc in failures]
            failed = {request for request, _ in failures}
            done = ScheduledBatch([e for e in batch.entries if e[0] not in failed])
        else:
            done = ScheduledBatch(batch.entries)
        if batch.lookahead:
            gains = {g[0]: g[1] for result in results for g in result.gains()}
            done.accepted = {r: tuple(gains[r][:-1]) for r in batch.lookahead if r in gains}
        tables = {r: len(r.block_table) for r in done.accepted}
        self.scheduler.on_step_done(done)  # the runner sampled exactly the requests it returns
        for request, accepted in done.accepted.items():
            self._count_speculation(request, proposals.get(request), accepted, tables[request])
        outputs += [self._fail(request, exc) for request, exc in done.failed]
        if forks:  # n > 1: prompts that completed now give their blocks to the other samples
            sampled = {g[0] for result in results for g in result.gains()}
            for leader in sampled & forks.keys():
                if leader.request_id in self.requests:  # not failed meanwhile
                    self._fork(leader, self._forks.pop(leader))
        self._append_sampled(results, outputs)

    def _propose(self, batch: ScheduledBatch) -> dict[Request, Proposal]:
        """Proposals for the requests that hold lookahead slots; each entry shrinks to 1 + the
        proposal's length (the slots past it are given back after the step). A failing
        proposer costs only the speedup: those requests decode as usual this step."""
        if not batch.lookahead:
            return {}
        requests = list(batch.lookahead)
        try:
            with ops.use_backend(self.backend):
                made = self.proposer.propose(requests, [batch.lookahead[r] for r in requests])
        except Exception:  # noqa: BLE001 - speculation is an optimisation: decode instead
            log.exception("the %s proposer failed; decoding without it", self.config.speculative)
            for request in requests:
                self.proposer.forget(request)
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

    def _count_speculation(
        self, request: Request, proposal: Proposal | None, accepted: tuple, table: int
    ) -> None:
        """Stats and the trace line of one verified request."""
        proposed = () if proposal is None else proposal.token_ids
        if proposed:
            self._spec_steps += 1
            self._spec_proposed += len(proposed)
            self._spec_accepted += len(accepted)
        if self.tracer and proposed:
            freed = table - len(request.block_table)
            self.tracer.speculated(
                request, proposed, accepted, len(proposed) - len(accepted), freed
            )

    def _fork(self, leader: Request, samples: list[Request]) -> None:
        """n > 1: the further samples take the first's prompt KV (Scheduler.fork); the K/V of
        a partial last block is copied into each sample's own block."""
        data = self.kv_cache.data
        for sample in samples:
            if sample.request_id in self.requests:
                copy = self.scheduler.fork(leader, sample)
                if copy is not None:
                    data[:, :, copy[1]] = data[:, :, copy[0]]

    def _forward(
        self,
        entries: list[tuple[Request, int]],
        forks: dict[Request, list[Request]] | None = None,
        proposals: dict[Request, Proposal] | None = None,
    ) -> tuple[list[StepResult], list[tuple[Request, Exception]]]:
        """Run the batch: its StepResult (one per request run alone after a failure), and
        (request, error) for those that failed. When the batch fails, each request runs alone
        to find who is at fault (rewriting the same K/V slots and redrawing the same seeded
        samples is harmless), so one bad request does not fail its neighbours."""
        with ops.use_backend(self.backend), self._shadowed():
            try:
                return [self._run_model(entries, forks, proposals)], []
            except (TensorParallelError, ShadowDivergence):
                raise  # not a request's fault (ranks out of step; strict shadow): no retries
            except Exception as exc:  # noqa: BLE001 - isolated below
                if len(entries) == 1:
                    return [], [(entries[0][0], exc)]
                log.warning("a batch of %d failed (%r); retrying each alone", len(entries), exc)
            results, failures = [], []
            for entry in entries:
                try:
                    results.append(self._run_model([entry], forks, proposals))
                except Exception as exc:  # noqa: BLE001 - this request's fault
                    failures.append((entry[0], exc))
            return results, failures

    def _shadowed(self):
        """Shadow mode: this step's op calls are checked against their references."""
        if self.shadow is None:
            return contextlib.nullcontext()
        return self.shadow.active(self.iteration)

    def _run_model(self, entries, forks, proposals) -> StepResult:
        """runner.run, given `proposals` only in a speculative step (a plain step's call is the
        two-argument one that tests substitute)."""
        if not proposals:
            return self.runner.run(entries, forks)
        mine = {entry[0]: proposals[entry[0]] for entry in entries if entry[0] in proposals}
        return self.runner.run(entries, forks, mine)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP = 1) and the async_scheduling
        worker thread, and on a GPU give the device memory back (the KV caches, the decode
        graphs, the weights of models from_config loaded): an engine created next in this
        process can have it. Idempotent; the engine runs no step after it."""
        if self.overlap is not None:
            self.overlap.close()
        self.model.tp.close()
        if self.model.device.type == "cuda":
            draft = getattr(self.proposer, "draft", None)
            owned = [m for m in (self.model, draft) if m is not None] if self.owns_model else []
            release_device_memory(
                [self.kv_cache, getattr(self.proposer, "kv_cache", None)],
                owned,
                self.runner.graphs,
            )

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished or self._undelivered:
            yield from self.step()
