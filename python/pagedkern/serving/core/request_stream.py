"""One request as the front end holds it: its samples' incremental detokenizers and stop
strings, turning the core's token-id deltas into the StreamOutputs a handler reads (see
engine_client.py for the protocol around it). It reaches its client through two callables,
`abort(engine request id, alone)` and `record(stream, sample, output, now)` (the metrics).

Delivery is batched: the frame handler appends each StreamOutput to the stream's list and wakes
its handler once; the handler takes everything that has arrived since it last looked. A handler
that keeps up gets one output per engine step; one that has fallen behind (the front end is
busy) gets several at once and writes them with one send, so the per-write costs (a task
wake-up, the ASGI send chain, h11, a socket syscall) shrink as the load grows."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...engine import FinishReason, SamplingParams
from ...engine.detokenizer import IncrementalDetokenizer
from ...engine.outputs import TokenLogprob
from ...engine.request import ENDED_BY_A_LIMIT
from ...model.tokenizer import Tokenizer
from .messages import SampleDelta

log = logging.getLogger("pagedkern.serving")


@dataclass(slots=True)
class StreamOutput:
    """One delta of one sample, as a handler reads it (the fields of RequestOutput that the
    responses use)."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None


def event_bytes(out: StreamOutput) -> int:
    """About the size of `out`'s SSE event (and of what holding it costs): the chunk's JSON
    around the text, the text, ~64 bytes per logprob entry (the token's and each top one's)."""
    size = 200 + 2 * len(out.text)
    if out.logprobs:
        size += sum(64 * (1 + len(lp.top)) for lp in out.logprobs)
    return size


class Backlog:
    """What one streamed response holds for a client that has not taken it yet: the outputs
    its streams keep for the handler and the events on their way to the socket (event_bytes
    each), bounded. Past `limit` bytes, `on_full` runs once (the response's connection is
    dropped and its requests aborted): a client that stops reading costs bounded memory."""

    def __init__(self, limit: int, on_full: Callable[[], None]):
        self.limit, self.on_full = limit, on_full
        self.size = 0
        self.full = False

    def add(self, size: int) -> None:
        self.size += size
        if self.size > self.limit and not self.full:
            self.full = True
            self.on_full()

    def sent(self, outputs) -> None:
        """These outputs' events have been written (or dropped)."""
        self.size -= sum(event_bytes(out) for out in outputs)

    def watch(self, stream: RequestStream) -> None:
        """Count `stream`'s outputs from now on (those it holds already included)."""
        stream.backlog = self
        self.add(sum(event_bytes(x) for x in stream._ready if isinstance(x, StreamOutput)))


@dataclass(slots=True)
class Sample:
    detokenizer: IncrementalDetokenizer
    done: bool = False  # finished, as the handler sees it
    last_token: float | None = None  # front-end clock


@dataclass(eq=False)
class RequestStream:
    """The handler's end of one request: StreamOutputs arrive by `put`, read by `batches`."""

    request_id: str
    params: SamplingParams
    stop_ids: frozenset[int]  # the core's finishing ids: they add no text
    tokenizer: Tokenizer
    abort: Callable[[str, bool], None]  # tell the core to abort an engine request id (alone?)
    record: Callable[[RequestStream, Sample, StreamOutput, float], None]  # the metrics
    arrival: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    finished: bool = False  # the handler has seen every sample finish (or closed)
    _ready: list = field(default_factory=list)  # StreamOutputs (or the failure) not yet read
    # the response's direct writer, while it streams (streaming.py): put() offers it each
    # output first; True: it delivered it (nothing for the handler to read)
    sink: Callable[[StreamOutput | BaseException], bool] | None = None
    backlog: Backlog | None = None  # the response's bound on what its client has not taken
    _closed: bool = False
    _wakeup: asyncio.Future | None = None  # the waiting handler's, if it waits
    pending: int = 0  # samples the core has not finished
    _open: int = 0  # samples the handler has not seen finished
    _aborted: bool = False
    _samples: list[Sample] = field(default_factory=list)
    # echo + logprobs: (prompt ids, per-token logprobs), from the core's first delta
    prompt_logprobs: tuple[tuple[int, ...], tuple[TokenLogprob | None, ...]] | None = None
    context: tuple[int, ...] = ()  # the prompt's last ids (IncrementalDetokenizer's context)

    def __post_init__(self) -> None:
        self.pending = self._open = self.samples
        params = self.params
        self._samples = [
            Sample(
                IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.min_tokens, context=self.context
                )
            )
            for _ in range(self.samples)
        ]

    @property
    def samples(self) -> int:
        return self.params.n

    def put(self, item: StreamOutput | BaseException) -> None:
        """One more output (or the failure that ends the stream): to the sink if it takes it
        (never ahead of outputs still waiting for the handler), else for the handler to read,
        waking it; nothing once the stream is closed)."""
        if self._closed:
            return  # nobody reads it
        if self.sink is not None and not self._ready:
            try:
                if self.sink(item):
                    return
            except Exception:  # noqa: BLE001 - never the frame handler's (the other streams')
                log.exception("request %s: writing an event failed", self.request_id)
                self.sink = None  # the handler meets the output in its own task
        self._ready.append(item)
        if self.backlog is not None and isinstance(item, StreamOutput):
            self.backlog.add(event_bytes(item))
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            if not wakeup.done():  # (cancelled: its handler has gone)
                wakeup.set_result(None)

    async def next_batch(self) -> list[StreamOutput]:
        """The StreamOutputs that arrived since the last call (waiting for one if none has);
        [] once the last sample's finished output has been taken. Raises EngineUnavailable if
        the engine core dies (on the call after the outputs that came before it)."""
        while not self.finished:
            if not self._ready:
                self._wakeup = asyncio.get_running_loop().create_future()
                await self._wakeup
                continue
            items, self._ready = self._ready, []
            batch = []
            for item in items:
                if isinstance(item, BaseException):
                    if batch:
                        self._ready = [item]  # raised by the next call
                        return batch
                    self.finished = True
                    raise item
                batch.append(item)
                self._open -= item.finished
                if self._open == 0:
                    self.finished = True
                    break
            return batch
        return []

    async def batches(self):
        """next_batch() until the stream ends, as an async iterator."""
        while batch := await self.next_batch():
            yield batch

    def fail(self, failure: BaseException) -> None:
        """End the stream with `failure` (its handler raises it) and abort what the core still
        runs of it."""
        self.put(failure)
        if self.pending and not self._aborted:
            self._aborted = True
            self.abort(self.request_id, False)

    def close(self) -> None:
        """Abort what the core still runs of this request and drop what it holds for the
        handler (idempotent)."""
        self.finished = True
        self._closed = True
        if self.backlog is not None:
            self.backlog.sent(x for x in self._ready if isinstance(x, StreamOutput))
        self._ready = []
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)  # (a waiting handler finds the stream finished)
        if self.pending and not self._aborted:
            self._aborted = True
            self.abort(self.request_id, False)

    def take(self, delta: SampleDelta, now: float) -> StreamOutput | None:
        """The core's delta for one sample -> the handler's StreamOutput (None: dropped, the
        sample already ended on a stop string)."""
        index, ids, finish, logprobs = delta.index, delta.token_ids, delta.finish, delta.logprobs
        if finish is not None:
            self.pending -= 1
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = (tuple(delta.prompt_ids), delta.prompt_logprobs)
        sample = self._samples[index]
        if sample.done:
            return None
        reason = None if finish is None else FinishReason(finish)
        detokenizer = sample.detokenizer
        texts, kept = [], len(ids)
        stop_token = reason is FinishReason.STOP and bool(ids) and ids[-1] in self.stop_ids
        text_ids = ids[:-1] if stop_token else ids
        for k, token in enumerate(text_ids):
            texts.append(detokenizer.add(token))
            if detokenizer.stopped_by is not None:
                kept, reason = k + 1, FinishReason.STOP
                self._stopped(index, finish is not None)
                break
        else:
            if reason is not None:
                texts.append(detokenizer.flush())
                if detokenizer.stopped_by is not None and reason in ENDED_BY_A_LIMIT:
                    reason = FinishReason.STOP  # (the last ids' text completed a stop string)
        if logprobs is not None:
            logprobs = logprobs[:kept]
        elif self.params.logprobs is not None:
            logprobs = ()
        finished = reason is not None
        text = "".join(texts)
        out = StreamOutput(text, ids[:kept], finished, reason, index, logprobs, delta.error)
        sample.done = out.finished
        self.record(self, sample, out, now)
        sample.last_token = now if out.token_ids else sample.last_token
        return out

    def take_token(self, token: int, now: float, itls: list[float]) -> StreamOutput | None:
        """take() of a column token (StepOutputs: sample 0's one token, which ends nothing in
        the core and carries nothing else) on its own lane: one detokenizer step, and its
        inter-token latency appended to `itls` for the caller to record with the message's
        others (one call a message); the same StreamOutput take() makes."""
        sample = self._samples[0]
        if sample.done:
            return None
        detokenizer = sample.detokenizer
        text = detokenizer.add(token)
        logprobs = None if self.params.logprobs is None else ()
        if detokenizer.stopped_by is None:
            out = StreamOutput(text, [token], False, None, 0, logprobs)
        else:
            self._stopped(0, False)
            out = StreamOutput(text, [token], True, FinishReason.STOP, 0, logprobs)
            sample.done = True
        if out.finished or sample.last_token is None:
            self.record(self, sample, out, now)
        else:
            itls.append(now - sample.last_token)
        sample.last_token = now
        return out

    def _stopped(self, index: int, core_finished: bool) -> None:
        """A stop string ended sample `index`: the core need not run it on."""
        if core_finished or self._aborted:
            return
        if self.samples == 1:
            self._aborted = True
            self.abort(self.request_id, False)
        elif index > 0:  # an n > 1 sample's own id
            self.abort(f"{self.request_id}.{index}", False)
        else:  # the first sample's id is the request's: alone, or the others would end too
            self.abort(self.request_id, True)
