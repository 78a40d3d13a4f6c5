"""The second half of an engine step: append each request's sampled tokens, detokenize, check
every stop condition, and finish the requests that stopped (their blocks go back at once).

Stop checks after each token, in order: a stop token id (EOS too), the grammar's end, a stop
string (the detokenizer finds it), max_tokens, the context. A verified speculative run is
appended token by token with every check, and the tokens after a stop are dropped.

The hot path is a plain decode: one token, no logprobs, no grammar, no tracer. Those take the
fast lane of `_append_sampled`, one loop with the checks inlined (no per-token method calls);
everything else goes through `_append`. Both make the same outputs: tests/test_engine*.py run
both lanes. With `token_deltas` set (the HTTP core), the fast lane's tokens that end nothing
become two list appends instead of a RequestOutput each (outputs.TokenDeltas).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .outputs import RequestOutput, TokenDeltas, TokenLogprob
from .request import FinishReason, Request

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..model import Tokenizer
    from .block_pool import BlockPool
    from .detokenizer import IncrementalDetokenizer
    from .runner import StepResult
    from .scheduler import Scheduler
    from .speculative import Proposer
    from .trace import Tracer

log = logging.getLogger("pagedkern.engine")


class Appending:
    """Engine's appending, stop checks and finishing (a mixin: the state is the engine's)."""

    requests: dict[str, Request]
    tokenizer: Tokenizer
    pool: BlockPool
    clock: Callable[[], float]
    scheduler: Scheduler
    proposer: Proposer | None
    tracer: Tracer | None
    max_model_len: int
    _detokenizers: dict[str, IncrementalDetokenizer]
    _stop_ids: dict[str, frozenset[int]]
    _timed: dict[str, Request]
    _forks: dict[Request, list[Request]]
    _undelivered: list[RequestOutput]
    token_deltas: TokenDeltas | None
    _num_generated_tokens: int
    _num_finished: int

    def _append_sampled(self, results: Sequence[StepResult], outputs: list[RequestOutput]) -> None:
        """Append each sampled request's tokens, except for those that ended meanwhile (failed
        this step, aborted, or with async_scheduling stopped a step earlier: that token is
        discarded; a request that ended is no longer in `requests`)."""
        now = self.clock()
        for result in results:
            if self.tracer is None:
                self._append_plain(result, now, outputs)
                verified = [(r, tokens, None, None) for r, tokens in result.verified]
                self._append_each(verified, now, outputs)
            else:
                self._append_each(result.gains(), now, outputs)

    def _append_plain(self, result: StepResult, now: float, outputs: list[RequestOutput]) -> None:
        """The sampled rows of `result` (one token each): plain decodes in the fast lane, the
        rest (logprobs, grammar) through `_append`."""
        requests, detokenizers, stop_ids = self.requests, self._detokenizers, self._stop_ids
        max_model_len, of, emit = self.max_model_len, RequestOutput.of, outputs.append
        logprobs = result.logprobs or [None] * len(result.requests)
        deltas = self.token_deltas  # (the HTTP core's columns: see outputs.TokenDeltas)
        if deltas is not None:
            delta_id, delta_token = deltas.request_ids.append, deltas.token_ids.append
        appended = 0
        for request, token, logprob in zip(result.requests, result.token_ids, logprobs):
            rid = request.request_id
            if requests.get(rid) is not request:
                continue  # ended meanwhile: the token is discarded
            try:
                if logprob is not None or request.grammar is not None:
                    emit(self._append(request, (token,), now, logprob))
                    continue
                ids = request.output_ids
                ids.append(token)
                request.token_times.append(now)
                appended += 1
                state = request.logits_state
                if state.penalised:
                    state.append(token)
                if request.first_token_time is None:
                    request.first_token_time = now
                if token in stop_ids[rid]:
                    emit(self._finish(request, FinishReason.STOP, (token,)))
                    continue
                detokenizer = detokenizers.get(rid)
                if detokenizer is None:
                    text = ""
                else:
                    text = detokenizer.add(token)
                    if detokenizer.stopped_by is not None:
                        emit(self._finish(request, FinishReason.STOP, (token,), text))
                        continue
                n = len(ids)
                if n >= request.params.max_tokens:
                    emit(self._finish(request, FinishReason.LENGTH, (token,), text))
                elif len(request.prompt_ids) + n >= max_model_len:
                    emit(self._finish(request, FinishReason.CONTEXT, (token,), text))
                elif deltas is not None and n > 1 and not text and request.parent_id is None:
                    delta_id(rid)
                    delta_token(token)
                else:
                    emit(of(request, text, (token,), False))
            except Exception as exc:  # noqa: BLE001 - e.g. its detokenization: it fails alone
                if rid in requests:
                    emit(self._fail(request, exc))
        self._num_generated_tokens += appended

    def _append_each(
        self,
        gains: list[tuple],
        now: float,
        outputs: list[RequestOutput],
    ) -> None:
        """(request, tokens, logits row, logprob) per request, each through `_append`."""
        for request, tokens, logits, logprob in gains:
            if self.requests.get(request.request_id) is not request:
                continue
            try:
                if self.tracer and logits is not None:
                    self.tracer.candidates(request, logits, tokens[0], self.tokenizer)
                outputs.append(self._append(request, tokens, now, logprob))
            except Exception as exc:  # noqa: BLE001 - e.g. its detokenization: it fails alone
                if request.request_id in self.requests:
                    outputs.append(self._fail(request, exc))

    def _append(
        self,
        request: Request,
        tokens: Sequence[int],
        now: float,
        logprob: TokenLogprob | None = None,
    ) -> RequestOutput:
        """Append this step's tokens (one, or a verified run) with every stop check after each:
        the tokens after a stop are dropped. One output carries them all."""
        logprobs = None if logprob is None else (logprob,)
        texts = []
        for n, token in enumerate(tokens, 1):
            reason, text = self._append_one(request, token, now)
            texts.append(text)
            if reason is not None:
                return self._finish(request, reason, tuple(tokens[:n]), "".join(texts), logprobs)
        return RequestOutput.of(request, "".join(texts), tuple(tokens), False, logprobs=logprobs)

    def _append_one(
        self, request: Request, token: int, now: float
    ) -> tuple[FinishReason | None, str]:
        """One token: (why the request stops, or None; the text it adds)."""
        request.output_ids.append(token)
        request.logits_state.append(token)
        request.token_times.append(now)
        self._num_generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        if token in self._stop_ids[request.request_id]:
            return FinishReason.STOP, ""
        grammar_done = request.grammar is not None and request.grammar.accept(token)
        detokenizer = self._detokenizers.get(request.request_id)
        text = "" if detokenizer is None else detokenizer.add(token)
        if grammar_done or (detokenizer is not None and detokenizer.stopped_by is not None):
            return FinishReason.STOP, text
        if len(request.output_ids) >= request.params.max_tokens:
            return FinishReason.LENGTH, text
        if len(request.prompt_ids) + len(request.output_ids) >= self.max_model_len:
            return FinishReason.CONTEXT, text  # (num_tokens counts the tokens in flight)
        if self.tracer:
            self.tracer.token(request, token, text)
        return None, text

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> RequestOutput:
        freed = list(request.block_table)
        if self.proposer is not None:
            self.proposer.forget(request)
        # n > 1, finished before its prompt was done: its samples end with it (those not
        # ended already, e.g. by the abort of the whole request)
        waiting = [s for s in self._forks.pop(request, ()) if s.request_id in self.requests]
        if waiting:
            self._undelivered += [self._finish(s, reason) for s in waiting]
        self.scheduler.finish(request)
        request.finish_reason = reason
        request.finish_time = self.clock()
        detokenizer = self._detokenizers.pop(request.request_id, None)
        self._stop_ids.pop(request.request_id)
        self._timed.pop(request.request_id, None)
        del self.requests[request.request_id]
        self._num_finished += 1
        text += "" if detokenizer is None else detokenizer.flush()
        if self.tracer:
            self.tracer.finished(request, text, freed, self.pool)
        return RequestOutput.of(request, text, token_ids, True, reason, logprobs)

    def _fail(self, request: Request, exc: BaseException) -> RequestOutput:
        """Finish a request with FinishReason.ERROR; `error` (and the log) say why."""
        request.error = f"{type(exc).__name__}: {exc}"
        log.warning("request %s failed: %s", request.request_id, request.error, exc_info=exc)
        try:
            return self._finish(request, FinishReason.ERROR)
        except Exception:  # noqa: BLE001 - broken state: drop the request without its blocks
            log.exception("finishing request %s failed", request.request_id)
            for table in (self.requests, self._detokenizers, self._stop_ids, self._timed):
                table.pop(request.request_id, None)
            request.finish_reason = FinishReason.ERROR
            return RequestOutput.of(request, "", (), True, FinishReason.ERROR)

    def _fail_all(
        self, requests: list[Request], exc: BaseException, outputs: list[RequestOutput]
    ) -> None:
        for request in requests:
            if request.request_id in self.requests:  # not already finished this step
                outputs.append(self._fail(request, exc))
