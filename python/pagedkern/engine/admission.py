"""Requests in and out of the engine: admission (`add_request` checks every field and makes one
Request per sample), cancellation (`abort`) and `stream`, one request's outputs as the engine
steps. A mixin of Engine (engine.py): the state is the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer
from .logits_processing import LogitsState
from .outputs import RequestOutput
from .overlap import needs_sync
from .request import FinishReason, Request
from .sampling_params import SamplingParams
from .validation import ParameterTypeError, check_messages, check_number, check_token_ids

if TYPE_CHECKING:
    import itertools
    import random
    from collections.abc import Callable

    from ..model import Tokenizer
    from .scheduler import Scheduler
    from .structured_output import CompiledGrammar
    from .trace import Tracer


class Admission:
    """Engine's request admission, cancellation and streaming."""

    tokenizer: Tokenizer
    vocab_size: int
    scheduler: Scheduler
    tracer: Tracer | None
    detokenize: bool
    clock: Callable[[], float]
    requests: dict[str, Request]
    _detokenizers: dict[str, IncrementalDetokenizer]
    _stop_ids: dict[str, frozenset[int]]
    _timed: dict[str, Request]
    _forks: dict[Request, list[Request]]
    _undelivered: list[RequestOutput]
    _ids: itertools.count
    _seeds: random.Random
    _num_prompt_tokens: int

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
        structured_output.GrammarCompilePool); None: compiled here, once (cached per schema)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ParameterTypeError(f"params must be a SamplingParams, got {params!r}")
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_ids")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ParameterTypeError(f"request_id must be a non-empty string, got {request_id!r}")
        if arrival_time is not None:
            check_number("arrival_time", arrival_time)
        if messages is not None:
            messages = check_messages(messages)
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if prompt_ids is None:
            if not isinstance(prompt, str):
                raise ParameterTypeError(f"prompt must be a string, got {prompt!r}")
            if not prompt:
                raise ValueError("the prompt is empty")
            # Raw text gets what the tokenizer's config adds around it (e.g. BOS, as HF and
            # vLLM do); a rendered chat template already carries its own.
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=messages is None)
        prompt_ids = check_token_ids("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        for name, token in params.token_ids_used():
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"{name}: {token} is not a token id (vocabulary {self.vocab_size})"
                )
        if params.stop and not self.detokenize:
            raise ValueError("stop: stop strings need an engine that detokenizes")
        request_id = request_id or f"R{next(self._ids)}"
        ids = [request_id] + [f"{request_id}.{i}" for i in range(1, params.n)]
        if any(i in self.requests for i in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        grammars = self._grammars(params, grammar)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        arrival = self.clock() if arrival_time is None else arrival_time
        eos = () if params.ignore_eos else self.tokenizer.stop_token_ids
        stop_ids = frozenset(params.stop_token_ids).union(eos)
        samples = []
        for i, rid in enumerate(ids):
            sample = Request(
                rid,
                prompt_ids,
                params,
                messages=messages,
                prompt_text=prompt,
                seed=(seed + i + 2**63) % 2**64 - 2**63,  # sample i: its own seed stream
                arrival_time=arrival,
                sample_index=i,
                parent_id=request_id if params.n > 1 else None,
                grammar=grammars[i],
            )
            sample.logits_state = LogitsState(params, prompt_ids, stop_ids, self.vocab_size)
            sample.needs_sync = needs_sync(sample)
            samples.append(sample)
        request = samples[0]
        self.scheduler.add(request)
        if len(samples) > 1:
            self._forks[request] = samples[1:]
        for sample in samples:
            rid = sample.request_id
            self.requests[rid] = sample
            if self.detokenize:
                self._detokenizers[rid] = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.min_tokens
                )
            self._stop_ids[rid] = stop_ids
            if params.timeout is not None:
                self._timed[rid] = sample
        self._num_prompt_tokens += len(prompt_ids)
        if self.tracer:
            self.tracer.request_added(request)
        return request

    def _grammars(self, params: SamplingParams, grammar: CompiledGrammar | None) -> list:
        """One structured-output matcher per sample (None without response_format): the
        schema compiled once, each sample's matcher a copy."""
        if params.response_format is None:
            return [None] * params.n
        if grammar is None:
            from .structured_output import grammar_compiler

            compiler = grammar_compiler(self.tokenizer, self.vocab_size)
            grammar = compiler.compile(params.response_format)
        return [grammar.matcher() for _ in range(params.n)]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (caller gone); its blocks return to the pool at once. An n > 1
        request's id ends every sample still running, also once its first sample has ended
        (their outputs go to the next step(), or pop_undelivered()); a sample's own id
        (`<id>.<i>`) ends that sample alone. None: nothing of that id was running."""
        request = self.requests.get(request_id)
        samples = [
            r for r in self.requests.values() if r.parent_id == request_id and r is not request
        ]
        self._undelivered += [self._finish(r, FinishReason.ABORT) for r in samples]
        return None if request is None else self._finish(request, FinishReason.ABORT)

    def pop_undelivered(self) -> list[RequestOutput]:
        """Outputs produced outside step() (an aborted n > 1 request's other samples) that the
        next step() would return: for a caller that may not step again."""
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def stream(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[Mapping] | None = None,
        prompt_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they are produced. Other requests keep running in
        the same steps; their outputs are kept for the next `step()` (or another stream), not
        dropped. Closing the generator early cancels the request."""
        request = self.add_request(
            prompt, params, messages=messages, prompt_ids=prompt_ids, request_id=request_id
        )
        rid = request.request_id
        try:
            while True:
                outputs = self.step()
                mine = [o for o in outputs if o.request_id == rid]
                self._undelivered += [o for o in outputs if o.request_id != rid]
                if not mine and rid not in self.requests:
                    return  # finished elsewhere (aborted by another caller)
                for output in mine:
                    yield output
                    if output.finished:
                        return
        finally:
            if rid in self.requests:
                self.abort(rid)
