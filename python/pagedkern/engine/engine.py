"""The serving engine: requests in, token deltas out, many requests sharing each forward pass.

One `step()` is one iteration of the reference document's loop: expire timed-out requests,
schedule (decodes and prompt chunks under the token budget), run the model, sample, append,
detokenize, check every stop condition, free the KV blocks of finished requests.

`Engine` owns the model, the KV cache and the step loop; the rest is done by collaborators,
each with its own state:

- `Admission` (admission.py): add_request's arguments -> checked Requests, one per sample,
  each carrying its own state (stop ids, detokenizer, deadline, the samples that fork from it).
- `Scheduler` (scheduler.py) over the `BlockPool` (block_pool.py): what runs each step; both
  made with the KV cache they hand out (`KVCacheSetup`, kv_setup.py: its size and context).
- `StepExecutor` (step_executor.py): a scheduled batch run to its appended outputs, through
  `IsolatingForward` (forward.py) over the `ModelRunner` (runner.py): the forward pass and
  sampling, with a failure pinned on the request that caused it.
- `OutputProcessor` (output_processor.py): the running requests; appends sampled tokens, runs
  the stop checks, makes the outputs and finishes requests.
- `Speculation` (speculative/speculation.py) with a proposer: speculative decoding's proposals
  and counts. With it a decoding request runs as 1 + k rows, verification keeps the accepted
  prefix plus one recovered or bonus token, the rejected tokens' KV slots are rewound
  (Scheduler.on_step_done), and a stop inside an accepted run drops the tokens after it.
- `Overlap` (overlap.py), with async_scheduling: a step launches the next batch on a worker
  thread before it completes the one in flight; its outputs are those of the step before.

Bad input is refused at admission (ValueError naming the field). Should a step still fail, the
failure is pinned on the request(s) it can be attributed to (the scheduler isolates a request's
own hashing and accounting; a failed forward pass is retried request by request): those finish
with FinishReason.ERROR and their blocks go back; a failure nobody can be blamed for finishes
that step's requests. Either way the engine stays usable.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .. import envs, ops
from ..model import LlamaModel, Tokenizer
from ..ops.shadow import ShadowDivergence, ShadowReport
from ..parallel import TensorParallelError
from .admission import Admission
from .config import EngineConfig
from .forward import IsolatingForward
from .hybrid_tables import KIND_NAMES
from .kernel_policy import pick_device, step_graphs
from .kv_budget import release_device_memory
from .kv_setup import KVCacheSetup
from .output_processor import OutputProcessor
from .output_stream import OutputStream
from .outputs import EngineStats, RequestOutput
from .overlap import Overlap
from .request import Request
from .runner import ModelRunner
from .scheduler import ScheduledBatch
from .speculative import load_draft, make_proposer
from .speculative.speculation import Speculation
from .step_executor import StepExecutor
from .trace import Tracer

if TYPE_CHECKING:
    from .sampling_params import SamplingParams
    from .structured_output import CompiledGrammar


def _setting(holder: str, name: str, doc: str) -> property:
    """An engine attribute that is the `holder` collaborator's own."""

    def get(engine: Engine):
        return getattr(getattr(engine, holder), name)

    def set_(engine: Engine, value) -> None:
        setattr(getattr(engine, holder), name, value)

    return property(get, set_, doc=doc)


class Engine:
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
        # The op backend is this engine's setting, applied around its own forward passes (a
        # context variable), never flipped for the whole process.
        self.backend = config.backend
        self.vocab_size = model.config.vocab_size
        context = min(config.max_model_len or model.max_positions, model.max_positions)
        # shadow mode checks each op call on the host: every step runs eagerly, through ops
        shadow = config.shadow or envs.get("PAGEDKERN_SHADOW")
        self.shadow = None if shadow == "off" else ShadowReport(shadow == "strict")
        graphs, piecewise = step_graphs(model, config, shadowed=self.shadow is not None)
        self.broken: TensorParallelError | None = None  # the TP group failed: nothing runs
        self.closed = False  # close() ran: nothing runs
        with ops.use_backend(self.backend):  # the profiling pass and graph capture run ops
            draft = load_draft(config, model)  # its weights and KV cache count in the budget
            kv = KVCacheSetup.allocate(model, config, context, None if draft is None else draft[0])
            self.kv_cache, self.max_model_len = kv.kv_cache, kv.max_model_len
            self.runner = ModelRunner(
                model,
                self.kv_cache,
                config.max_num_seqs,
                self.max_model_len,
                cuda_graphs=graphs,
                piecewise_tokens=config.max_num_batched_tokens if piecewise else None,
            )
        self.scheduler = kv.scheduler(model, config)
        self.pool = self.scheduler.pool
        self.forward = IsolatingForward(self.runner, self.backend, self.shadow)
        # async_scheduling: steps run on a worker thread, the next scheduled meanwhile
        overlap = (
            Overlap(self.runner, self.scheduler, self.backend) if config.async_scheduling else None
        )
        with ops.use_backend(self.backend):
            proposer = make_proposer(config, self.kv_cache, draft)
        self.speculation = Speculation(config.speculative, self.backend)
        self.admission = Admission(tokenizer, self.vocab_size, self.scheduler.config.max_model_len)
        self.output = OutputProcessor(
            tokenizer, self.pool, self.max_model_len, self._release, time.monotonic, tracer
        )
        self.executor = StepExecutor(
            self.forward, self.scheduler, self.output, self.speculation, proposer, overlap,
            self.kv_cache,
        )  # fmt: skip
        self.requests: dict[str, Request] = self.output.requests  # the running ones, by id
        self.iteration = 0
        self._num_prompt_tokens = 0

    # Settings other layers change after construction (the HTTP core, the CLI's --trace,
    # tests), each held by the collaborator that uses it.
    tracer = _setting("output", "tracer", "Tracer | None: the --trace narrator.")
    proposer = _setting("executor", "proposer", "Speculative decoding's proposer, or None.")
    overlap = _setting("executor", "overlap", "Overlap | None: async_scheduling's worker.")
    clock = _setting("output", "clock", "Arrival, token and finish times (tests substitute it).")
    detokenize = _setting(
        "admission",
        "detokenize",
        "False: outputs carry token ids only, no text (the HTTP front end detokenizes; stop "
        "strings are then refused). Set it before adding requests.",
    )
    token_deltas = _setting(
        "output",
        "token_deltas",
        "TokenDeltas (the HTTP core): plain decode tokens come out as two columns, not outputs.",
    )

    @classmethod
    def from_config(cls, config: EngineConfig, tracer: Tracer | None = None) -> Engine:
        device = torch.device(config.device) if config.device else pick_device(config.backend)
        shard = None
        if config.tensor_parallel_size > 1:  # this rank reads its part of the checkpoint only
            from ..parallel.engine_group import this_rank_shard

            shard = this_rank_shard(config.tensor_parallel_size, config.expert_parallel)
        model, tokenizer = config.model_spec().load(device, shard)
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
            kv_blocks_by_kind=tuple(
                (name, pool.used_by_kind[k], pool.peak_by_kind[k])
                for k, name in enumerate(KIND_NAMES)
            )
            if scheduler.hybrid is not None
            else (),
            num_blocks_free=pool.num_free,
            block_size=pool.block_size,
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self.output.num_generated_tokens,
            num_finished=self.output.num_finished,
            num_iterations=self.iteration,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            speculative=self.config.speculative,
            num_spec_steps=self.speculation.num_steps,
            num_spec_proposed=self.speculation.num_proposed,
            num_spec_accepted=self.speculation.num_accepted,
        )

    # --- requests in and out ------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[Mapping] | None = None,
        prompt_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """Admit one request: raw prompt text, chat `messages` (rendered with the model's chat
        template) or token ids (ints in [0, vocab size)). Raises ValueError naming the field
        for bad input (ParameterTypeError, also a TypeError, for a wrong type) and
        RequestRejected (a ValueError) for one that can never fit the context or the KV cache.
        arrival_time (on `clock`'s scale): when the request really arrived, e.g. at an HTTP
        server, for TTFT. grammar: params.response_format compiled already (e.g. on a
        structured_output.GrammarCompilePool); None: compiled here, once (cached per schema).
        With params.n > 1 the further samples are `<id>.1` ... and fork from its prompt.
        RuntimeError once the engine is closed."""
        self._check_open()
        samples = self.admission.make(
            prompt,
            params,
            messages=messages,
            prompt_ids=prompt_ids,
            request_id=request_id,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            grammar=grammar,
            in_use=self.requests,
        )
        request = samples[0]
        self.scheduler.add(request)
        self.output.add(samples)
        self._num_prompt_tokens += len(request.prompt_ids)
        if self.tracer:
            self.tracer.request_added(request)
        return request

    def abort(self, request_id: str, *, alone: bool = False) -> RequestOutput | None:
        """Cancel a request (caller gone); its blocks return to the pool at once. An n > 1
        request's id ends every sample still running, also once its first sample has ended
        (their outputs go to the next step(), or pop_undelivered()), and with `alone` its first
        sample only; a sample's own id (`<id>.<i>`) ends that sample alone. None: nothing of
        that id was running. The ABORT output also carries the deltas of the request's outputs
        not yet delivered (a stream() set them aside for the next step()): nothing of it comes
        after its final output."""
        return self.output.abort(request_id, alone)

    def pop_undelivered(self) -> list[RequestOutput]:
        """Outputs produced outside step() (an aborted n > 1 request's other samples) that the
        next step() would return: for a caller that may not step again."""
        outputs, self.output.undelivered = self.output.undelivered, []
        return outputs

    def stream(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[Mapping] | None = None,
        prompt_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> OutputStream:
        """Admit a request (now: add_request's errors are raised here) and iterate over its
        outputs as they are produced, every sample's with params.n > 1 (their request_id says
        which; the iteration ends when all have finished). Other requests keep running in the
        same steps; their outputs are kept for the next `step()` (or another stream), not
        dropped. Closing the iterator (or dropping it) cancels what still runs of the request;
        its outputs go with it."""
        request = self.add_request(
            prompt, params, messages=messages, prompt_ids=prompt_ids, request_id=request_id
        )
        samples = [request, *(request.forks or ())]
        return OutputStream(self.step, self.abort, self.output, samples)

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished or self.output.undelivered:
            yield from self.step()

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; the outputs it produced (and any that `stream()` set aside for
        requests other than its own). Never raises for a request's fault; raises
        TensorParallelError once a broken TP group has failed every request."""
        self._check_open()
        if self.broken is not None:
            raise self.broken
        outputs = self.pop_undelivered()
        self._step(outputs)
        # The samples an n > 1 request's first one ended with it this step (a timeout or a
        # failure before they forked): now, not at a next step a caller may never take.
        outputs += self.pop_undelivered()
        return outputs

    def _step(self, outputs: list[RequestOutput]) -> None:
        """step()'s iteration: expire, schedule, run; its outputs appended to `outputs`."""
        output = self.output
        output.expire(outputs)
        try:
            batch = self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001 - the scheduler's own fault: fail who it holds
            output.fail_all(self.scheduler.running, exc, outputs)
            self.executor.drain(outputs)
            return
        outputs += [output.fail(request, exc) for request, exc in batch.failed]
        if self.proposer is not None:
            for victim in batch.preempted:
                self.proposer.forget(victim)
        self.iteration += bool(batch)
        try:
            self.executor.run(batch, self.iteration, outputs)
        except Exception as exc:  # noqa: BLE001 - not one request's fault (see _step_failed)
            self._step_failed(batch, exc, outputs)

    def _step_failed(
        self, batch: ScheduledBatch, exc: Exception, outputs: list[RequestOutput]
    ) -> None:
        """A step failed where no request can be blamed: its requests fail (with
        async_scheduling also those whose token was in flight: it will never come); a broken
        tensor-parallel group fails every request; strict shadow mode re-raises its report."""
        entries = [request for request, _ in batch.entries]
        if self.overlap is not None:
            self.overlap.take()
            stranded = [r for r in self.requests.values() if r.num_pending]
            self.output.fail_all(entries + stranded, exc, outputs)
        elif isinstance(exc, TensorParallelError):  # a rank is gone: nobody can be served
            self.broken = exc
            self.output.fail_all(self.requests.values(), exc, outputs)
        else:
            self.output.fail_all(entries, exc, outputs)
            if isinstance(exc, ShadowDivergence):
                raise exc  # strict shadow mode: stop with the report

    def _release(self, request: Request) -> None:
        """A finished request's blocks and proposer state go back (OutputProcessor.finish)."""
        if self.proposer is not None:
            self.proposer.forget(request)
        self.scheduler.finish(request)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed (its KV cache and weights may be gone)")

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP = 1) and the async_scheduling
        worker thread, and on a GPU give the device memory back (the KV caches, the decode
        graphs, the weights of models from_config loaded): an engine created next in this
        process can have it. Idempotent; after it step() and add_request() raise RuntimeError."""
        self.closed = True
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
