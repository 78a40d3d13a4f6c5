"""The serving engine: requests in, token deltas out, many requests sharing each forward pass.

One `step()` is one iteration of the reference document's loop: expire timed-out requests,
schedule (decodes and prompt chunks under the token budget), run the model, sample, append,
detokenize, check every stop condition, free the KV blocks of finished requests.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .. import ops
from .._extension import cuda_available, cuda_unavailable_reason
from ..model import LlamaModel, Tokenizer, load_model
from .block_pool import BlockPool
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_budget import kv_cache_blocks
from .request import FinishReason, Request
from .runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .trace import Tracer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new text and ids since the last output."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    request: Request


def pick_device(backend: str) -> torch.device:
    """The device a backend runs on; "cuda" without a usable GPU is an error that says why."""
    gpu = torch.cuda.is_available()
    if backend == "cuda" and not (gpu and cuda_available()):
        reason = cuda_unavailable_reason() or "torch sees no CUDA device"
        raise RuntimeError(f"--backend cuda needs a GPU and the kernels: {reason}")
    if backend == "auto" and gpu and not cuda_available():
        return torch.device("cpu")  # a GPU without our kernels: stay on the CPU reference
    return torch.device("cuda" if gpu else "cpu")


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig,
        tracer: Tracer | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.tracer = tracer
        context = min(config.max_model_len or model.max_positions, model.max_positions)
        num_blocks = config.num_blocks or kv_cache_blocks(model, config, context)
        # A sequence can never outgrow the whole cache: one that did would be preempted forever.
        self.max_model_len = min(context, num_blocks * config.block_size)
        self.kv_cache = model.allocate_kv_cache(num_blocks, config.block_size)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
        )
        graphs = config.cuda_graphs
        if graphs is None:  # on by default where kernels run on a GPU (the reference syncs)
            graphs = model.device.type == "cuda" and ops.get_backend() != "reference"
            graphs = graphs and model.kv_cache_dtype != "fp8"  # fp8 KV runs the reference ops
        self.runner = ModelRunner(
            model, self.kv_cache, config.max_num_seqs, self.max_model_len, cuda_graphs=graphs
        )
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._seeds = random.Random()
        self.iteration = 0
        self.clock = time.monotonic  # arrival, token and finish times; tests substitute it

    @classmethod
    def from_config(cls, config: EngineConfig, tracer: Tracer | None = None) -> Engine:
        ops.set_backend(config.backend)
        device = torch.device(config.device) if config.device else pick_device(config.backend)
        model, tokenizer = load_model(
            config.model,
            device,
            config.dtype,
            seed=config.seed,
            max_positions=config.max_model_len,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        return cls(model, tokenizer, config, tracer)

    def describe(self) -> str:
        """The model line of --trace / --stats, with the KV cache's size."""
        kv = self.kv_cache.data
        return f"{self.model.describe()}, {kv.numel() * kv.element_size() / 2**20:.0f} MiB KV"

    # --- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict] | None = None,
        prompt_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Admit one request: raw prompt text, chat `messages` (rendered with the model's chat
        template) or token ids. Raises ValueError for an empty prompt and RequestRejected (a
        ValueError) for one that can never fit the context or the KV cache. arrival_time (on
        `clock`'s scale): when the request really arrived, e.g. at an HTTP server, for TTFT."""
        params = params or SamplingParams()
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_ids")
        if messages is not None:
            if not messages:
                raise ValueError("messages must not be empty")
            prompt = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        if prompt_ids is None:
            if not prompt:
                raise ValueError("the prompt is empty")
            prompt_ids = self.tokenizer.encode(prompt)
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        request_id = request_id or f"R{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(
            request_id,
            prompt_ids,
            params,
            messages=list(messages or []) or None,
            prompt_text=prompt,
            seed=seed,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
        )
        self.scheduler.add(request)
        self.requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        if self.tracer:
            self.tracer.request_added(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (caller gone); its blocks return to the pool at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, FinishReason.ABORT)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        now = self.clock()
        outputs = [
            self._finish(r, FinishReason.TIMEOUT)
            for r in list(self.requests.values())
            if r.params.timeout is not None and now - r.arrival_time > r.params.timeout
        ]
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        self.iteration += 1
        if self.tracer:
            self.tracer.iteration(self.iteration, batch, self.pool)
        try:
            result = self.runner.run(batch.entries)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the engine and others live on
            for request, _ in batch.entries:
                request.error = f"{type(exc).__name__}: {exc}"
                outputs.append(self._finish(request, FinishReason.ERROR))
            return outputs
        self.scheduler.on_step_done(batch)  # the runner sampled exactly the requests it returns
        now = self.clock()
        for row, (request, token) in enumerate(zip(result.requests, result.token_ids, strict=True)):
            if self.tracer:
                self.tracer.candidates(request, result.logits[row], token, self.tokenizer)
            outputs.append(self._append(request, token, now))
        return outputs

    def _append(self, request: Request, token: int, now: float) -> RequestOutput:
        request.output_ids.append(token)
        request.token_times.append(now)
        if request.first_token_time is None:
            request.first_token_time = now
        params = request.params
        detokenizer = self._detokenizers[request.request_id]
        if (token in self.tokenizer.stop_token_ids and not params.ignore_eos) or (
            token in params.stop_token_ids
        ):
            return self._finish(request, FinishReason.STOP, [token])
        text = detokenizer.add(token)
        if detokenizer.stopped_by is not None:
            reason = FinishReason.STOP
        elif len(request.output_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        elif request.num_tokens >= self.max_model_len:
            reason = FinishReason.CONTEXT
        else:
            if self.tracer:
                self.tracer.token(request, token, text)
            return RequestOutput(request.request_id, text, [token], False, None, request)
        return self._finish(request, reason, [token], text)

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        token_ids: list[int] | None = None,
        text: str = "",
    ) -> RequestOutput:
        freed = list(request.block_table)
        self.scheduler.finish(request)
        request.finish_reason = reason
        request.finish_time = self.clock()
        text += self._detokenizers.pop(request.request_id).flush()
        del self.requests[request.request_id]
        if self.tracer:
            self.tracer.finished(request, text, freed, self.pool)
        return RequestOutput(request.request_id, text, token_ids or [], True, reason, request)

    # --- convenience -------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they are produced (other requests keep running in
        the same steps). Closing the generator early cancels the request."""
        request = self.add_request(prompt, params, messages=messages)
        try:
            while True:
                for output in self.step():
                    if output.request_id == request.request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            if request.request_id in self.requests:
                self.abort(request.request_id)

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished:
            yield from self.step()
