"""The output processor: the second half of an engine step. It holds the engine's running
requests (`requests`), appends each one's sampled tokens, detokenizes them, checks every stop
condition, makes the outputs and finishes the requests that stopped (their blocks go back at
once through the engine's `release` callback).

Stop checks after each token, in order: a stop token id (EOS too), the grammar's end, a stop
string (the request's detokenizer finds it), max_tokens, the context. A verified speculative
run is appended token by token with every check, and the tokens after a stop are dropped.

`append` is the only append path: one loop over (request, tokens) runs, a plain decode being a
run of one token. It inlines the checks (no per-token method call) because it runs for every
sequence of every step. With `token_deltas` set (the HTTP core), a plain decode's token that
ends nothing becomes two list appends instead of a RequestOutput (outputs.TokenDeltas).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING

from .logits_processing import NoTokenAllowed
from .non_finite import NON_FINITE, NonFiniteLogits
from .outputs import RequestOutput, TokenDeltas, TokenLogprob
from .request import ENDED_BY_A_LIMIT, FinishReason, Request
from .structured_output import StructuredOutputError

if TYPE_CHECKING:
    from ..model import Tokenizer
    from .block_pool import BlockPool
    from .runner import StepResult
    from .trace import Tracer

log = logging.getLogger("pagedkern.engine")


class OutputProcessor:
    """The running requests and what happens to them after sampling. release(request): the
    engine gives a finished request's blocks (and its proposer state) back."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pool: BlockPool,
        max_model_len: int,
        release: Callable[[Request], None],
        clock: Callable[[], float],
        tracer: Tracer | None = None,
    ):
        self.tokenizer = tokenizer
        self.pool = pool  # (the tracer's view of the blocks)
        self.max_model_len = max_model_len
        self.release = release
        self.clock = clock
        self.tracer = tracer
        # the HTTP core: plain decode tokens as two columns instead of RequestOutputs
        self.token_deltas: TokenDeltas | None = None
        # ids whose output this step has made already: their tokens stay outputs (a column,
        # applied before the step's outputs, would run ahead of it; StepExecutor sets it)
        self.had_output: Collection[str] = ()
        self.requests: dict[str, Request] = {}
        # indexes over `requests`, so a step scans only the few requests they hold
        self.timed: dict[str, Request] = {}  # those with a deadline
        self.forking: set[Request] = set()  # those whose samples wait to fork (Request.forks)
        self.undelivered: list[RequestOutput] = []  # outputs made outside a step
        self.num_generated_tokens = self.num_finished = 0

    def add(self, samples: Sequence[Request]) -> None:
        """Track newly admitted requests (an n > 1 request's samples, the first one first)."""
        for sample in samples:
            params = sample.params
            context = self.max_model_len - len(sample.prompt_ids)
            sample.output_limit = min(params.max_tokens, context)
            sample.columnar = (
                params.logprobs is None and sample.grammar is None and sample.parent_id is None
            )
            self.requests[sample.request_id] = sample
            if sample.deadline is not None:
                self.timed[sample.request_id] = sample
        if samples[0].forks:
            self.forking.add(samples[0])

    def take_forks(self, request: Request) -> list[Request]:
        """The samples still running that wait for `request`'s prompt (taken: it forks now)."""
        self.forking.discard(request)
        forks, request.forks = request.forks or [], None
        return [s for s in forks if s.request_id in self.requests]

    def expire(self, outputs: list[RequestOutput]) -> None:
        """Finish the requests past their deadline."""
        if self.timed:
            now = self.clock()
            expired = [r for r in self.timed.values() if now > r.deadline]
            # (an n > 1 request's first sample ends the samples waiting for it: once)
            live = self.requests
            outputs += [
                self.finish(r, FinishReason.TIMEOUT) for r in expired if r.request_id in live
            ]

    def abort(self, request_id: str, alone: bool) -> RequestOutput | None:
        """Engine.abort: the request's ABORT output (None: not running), its other samples'
        (unless `alone`) to `undelivered`."""
        request = self.requests.get(request_id)
        if not alone:
            samples = [
                r for r in self.requests.values() if r.parent_id == request_id and r is not request
            ]
            self.undelivered += [self.finish(r, FinishReason.ABORT) for r in samples]
        if request is None:
            return None
        # Its outputs that a stream() set aside and no step() has returned yet go out inside
        # the ABORT output: returned after it, they would follow the request's final output.
        pending = [o for o in self.undelivered if o.request_id == request_id]
        if not pending:
            return self.finish(request, FinishReason.ABORT)
        self.undelivered = [o for o in self.undelivered if o.request_id != request_id]
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = tuple(lp for o in pending for lp in o.logprobs or ())
        return self.finish(
            request,
            FinishReason.ABORT,
            tuple(t for o in pending for t in o.token_ids),
            "".join(o.text for o in pending),
            logprobs,
        )

    def append(self, results: Sequence[StepResult], outputs: list[RequestOutput]) -> None:
        """Append each sampled request's tokens, except for those that ended meanwhile (failed
        this step, aborted, or with async_scheduling stopped a step earlier: that token is
        discarded; a request that ended is no longer in `requests`)."""
        now = self.clock()
        for result in results:
            runs = zip(result.requests, zip(result.token_ids), result.logprobs or repeat(None))
            if result.verified:
                runs = chain(runs, ((r, tuple(run), None) for r, run in result.verified))
            self._append_runs(runs, self._logits_rows(result), now, outputs)

    def _logits_rows(self, result: StepResult) -> dict[Request, object] | None:
        """With a tracer: each sampled request's logits row (the tracer shows candidates)."""
        if self.tracer is None or result.logits is None:
            return None
        n = len(result.requests)
        return dict(zip(result.requests, result.logits[:n].unbind(0)))

    def _append_runs(
        self,
        runs: Iterable[tuple[Request, tuple[int, ...], TokenLogprob | None]],
        logits_rows: dict[Request, object] | None,
        now: float,
        outputs: list[RequestOutput],
    ) -> None:
        """(request, tokens, logprob or None) per request: a sampled row is a run of one
        token, a verified speculative run several."""
        requests, tracer = self.requests, self.tracer
        of, emit = RequestOutput.of, outputs.append
        STOP, LENGTH, CONTEXT = FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTEXT
        deltas = self.token_deltas  # (the HTTP core's columns: see outputs.TokenDeltas)
        had_output = self.had_output
        if deltas is not None:
            delta_id, delta_token = deltas.request_ids.append, deltas.token_ids.append
        appended = 0
        for request, tokens, logprob in runs:
            rid = request.request_id
            if requests.get(rid) is not request:
                continue  # ended meanwhile: the tokens are discarded
            try:
                if tokens[0] == NON_FINITE:
                    raise NonFiniteLogits(
                        "the model's logits were NaN or infinite (an activation overflowed: "
                        "a wider dtype, e.g. bfloat16 or float32, may hold it)"
                    )
                if logits_rows is not None and request in logits_rows:
                    row = logits_rows[request]
                    tracer.candidates(request, row, tokens[0], self.tokenizer)
                if request.first_token_time is None:
                    request.first_token_time = now
                state = request.logits_state
                if request.grammar is not None or (state is not None and state.restricts):
                    check_allowed(request, tokens[0])
                ids, text, before = request.output_ids, "", appended
                for token in tokens:  # every check after each token
                    ids.append(token)
                    request.token_times.append(now)
                    appended += 1
                    state = request.logits_state
                    if state.penalised:
                        state.append(token)
                    if token in request.stop_ids:
                        reason = STOP
                        break
                    detokenizer = request.detokenizer
                    if detokenizer is not None:
                        piece = detokenizer.add(token)
                        text += piece
                        if detokenizer.stopped_by is not None:  # a stop string
                            reason = STOP
                            break
                    if request.grammar is not None and request.grammar.accept(token):
                        reason = STOP  # the grammar's end
                        break
                    if len(ids) >= request.output_limit:
                        # (max_tokens first; the context counts the tokens in flight)
                        reason = LENGTH if len(ids) >= request.params.max_tokens else CONTEXT
                        break
                    if tracer is not None:
                        tracer.token(request, token, "" if detokenizer is None else piece)
                else:  # no stop
                    if (
                        deltas is not None
                        and not text
                        and len(ids) > 1
                        and len(tokens) == 1
                        and request.columnar
                        and rid not in had_output
                    ):
                        delta_id(rid)
                        delta_token(token)
                    else:
                        logprobs = None if logprob is None else (logprob,)
                        emit(of(request, text, tokens, False, None, logprobs))
                    continue
                logprobs = None if logprob is None else (logprob,)
                ran = tokens[: appended - before]  # the tokens after a stop are dropped
                emit(self.finish(request, reason, ran, text, logprobs))
            except Exception as exc:  # noqa: BLE001 - e.g. its detokenization: it fails alone
                if rid in requests:
                    emit(self.fail(request, exc))
        self.num_generated_tokens += appended

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> RequestOutput:
        freed = list(request.block_table)
        self.release(request)
        # n > 1, finished before its prompt was done: its samples end with it (those not
        # ended already, e.g. by the abort of the whole request)
        if request.forks:
            self.undelivered += [self.finish(s, reason) for s in self.take_forks(request)]
        request.finish_reason = reason
        request.finish_time = self.clock()
        self.timed.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.num_finished += 1
        detokenizer = request.detokenizer
        if detokenizer is not None:  # (after the bookkeeping: a decode that raises leaves none)
            text += detokenizer.flush()  # (the last ids' text may complete a stop string)
            if detokenizer.stopped_by is not None and reason in ENDED_BY_A_LIMIT:
                reason = request.finish_reason = FinishReason.STOP
        if self.tracer:
            self.tracer.finished(request, text, freed, self.pool)
        return RequestOutput.of(request, text, token_ids, True, reason, logprobs)

    def fail(self, request: Request, exc: BaseException) -> RequestOutput:
        """Finish a request with FinishReason.ERROR; `error` (and the log) say why."""
        request.error = f"{type(exc).__name__}: {exc}"
        # (its own parameters, or the model's numbers: no traceback)
        told = isinstance(exc, (NoTokenAllowed, StructuredOutputError, NonFiniteLogits))
        log.warning(
            "request %s failed: %s", request.request_id, request.error,
            exc_info=None if told else exc,
        )  # fmt: skip
        try:
            return self.finish(request, FinishReason.ERROR)
        except Exception:  # noqa: BLE001 - broken state: drop the request without its blocks
            log.exception("finishing request %s failed", request.request_id)
            self.requests.pop(request.request_id, None)
            self.timed.pop(request.request_id, None)
            self.forking.discard(request)
            request.finish_reason = FinishReason.ERROR
            return RequestOutput.of(request, "", (), True, FinishReason.ERROR)

    def fail_all(
        self, requests: Iterable[Request], exc: BaseException, outputs: list[RequestOutput]
    ) -> None:
        for request in list(requests):
            if request.request_id in self.requests:  # not already finished this step
                outputs.append(self.fail(request, exc))


def check_allowed(request: Request, token: int) -> None:
    """NoTokenAllowed when the sampled token is one the request's masks and bans refused: the
    samplers' fallback when they left none (response_format with allowed_token_ids, say)."""
    state, grammar = request.logits_state, request.grammar
    if (state is None or state.allows(token, request.output_ids)) and (
        grammar is None or grammar.allows(token)
    ):
        return
    params = request.params
    fields = [
        name
        for name, given in (
            ("response_format", params.response_format is not None),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("bad_words", bool(params.bad_words)),
            ("min_tokens", len(request.output_ids) < params.min_tokens),
        )
        if given
    ]
    raise NoTokenAllowed(
        f"{', '.join(fields)}: no token is allowed after {len(request.output_ids)} generated "
        "(together they mask every token; before min_tokens the stop tokens are masked too)"
    )
