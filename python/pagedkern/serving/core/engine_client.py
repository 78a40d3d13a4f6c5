"""The front end's handle on the engine core (engine_core.py): requests out, token deltas in.

Messages (messages.py) arrive on the event loop itself (`loop.add_reader` on the channel's
socket): each StepOutputs is fanned out to the per-request streams in one pass, no thread hop.
Text is made here: every sample has its own IncrementalDetokenizer with the request's stop
strings; when one matches, the sample finishes with "stop" and the core is told to abort it
(tokens it made in the meantime are dropped; n > 1: that sample alone, the others run on).
Stop token ids, EOS and max_tokens stay in the core.

Two ways to have a core: `EngineClient.spawn(config)` starts the core process (the server;
core_process.py), `EngineClient.in_thread(engine)` runs a core on a thread of this process over
the same messages (notebooks and tests). Messages to the core go through its outbox
(core_outbox.py: adds batched per event-loop iteration, an abort never before its add).

Cancellation: `RequestStream.close()` (the handler's `finally`: client gone, or the server
shutting down) sends an abort unless the core has finished every sample; the core runs it before
its next step and gives the KV blocks back. A stream leaves `num_live` once the core has
answered its last sample's finish.

A core that goes away (EOF, or a Dead message) fails every open stream with EngineUnavailable
(-> an error event or a 503) and calls `on_dead` (the server then exits non-zero).

A core that stops answering is found by the step watchdog (step_watchdog.py): while it is
`stalled`, new requests and /health get 503 and /metrics the last gauges; when it has been silent
for too long, the open requests fail with EngineUnavailable and are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable

from ...engine import Engine, EngineConfig, SamplingParams
from ...engine.detokenizer import CONTEXT_IDS
from ...model.tokenizer import Tokenizer
from .channel import Channel
from .client_errors import EngineUnavailable, refusal
from .core_outbox import CoreOutbox
from .core_process import spawn_core
from .engine_core import EngineCore, core_info
from .messages import (
    Abort,
    Added,
    AddRequest,
    CoreInfo,
    CoreMessage,
    Dead,
    EngineGauges,
    Refused,
    Stats,
    StatsQuery,
    StepOutputs,
    Stop,
)
from .metrics import ServerMetrics
from .open_requests import OpenRequests
from .request_stream import RequestStream, Sample, StreamOutput
from .step_watchdog import StepWatchdog

log = logging.getLogger("pagedkern.serving")
STOP_TIMEOUT_S = 30.0


class EngineClient:
    def __init__(
        self,
        channel: Channel,
        info: CoreInfo,
        tokenizer: Tokenizer,
        *,
        metrics: ServerMetrics | None = None,
        engine: Engine | None = None,
        start_core: Callable[[], None] | None = None,
        join_core: Callable[[float], None] | None = None,
    ):
        self.channel = channel
        self.info = info
        self.tokenizer = tokenizer
        self.metrics = metrics or ServerMetrics()
        self.engine = engine  # in-process cores only: read it once the core has ended
        self.on_dead: Callable[[str], None] | None = None  # the server's exit, non-zero
        self._start_core, self._join_core = start_core, join_core
        self._ids = itertools.count()
        self._open = OpenRequests()
        # (outbox.closed: why the core will answer no more)
        self.outbox = CoreOutbox(channel, self._unsendable)
        self._queries: dict[int, asyncio.Future] = {}
        self._stop_sent = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = threading.Condition()  # notified after every batch of messages
        self.num_live = 0  # streams the core has not finished
        self._last_gauges: EngineGauges | None = None
        self.watchdog = StepWatchdog(
            lambda: bool(self._open or self._queries),
            on_stalled=self._stalled,
            on_stalled_too_long=self._fail_stalled,
        )
        self._handlers = {
            StepOutputs: self._step_outputs,
            Added: self._added,
            Refused: self._refused,
            Stats: self._stats,
            Dead: self._dead_message,
        }

    @property
    def max_queue(self) -> int:
        return self.info.max_queue

    # --- making one -------------------------------------------------------------------------
    @classmethod
    def in_thread(
        cls,
        engine: Engine,
        max_queue: int | None = None,  # None: engine.config.max_queue
        metrics: ServerMetrics | None = None,
        make_core: Callable[[Engine, Channel, int | None], EngineCore] = EngineCore,
    ) -> EngineClient:
        """A core for `engine` (made by `make_core(engine, channel, max_queue)`) on a thread
        of this process (started by `start`)."""
        front, back = multiprocessing.Pipe()
        core = make_core(engine, Channel(back), max_queue)
        thread = threading.Thread(target=core.run, name="pagedkern-engine", daemon=True)

        def join(timeout: float) -> None:
            if thread.is_alive():
                thread.join(timeout)

        info = core_info(engine, core.max_queue)
        return cls(
            Channel(front), info, engine.tokenizer, metrics=metrics, engine=engine,
            start_core=thread.start, join_core=join,
        )  # fmt: skip

    @classmethod
    def spawn(
        cls,
        config: EngineConfig,
        max_queue: int | None = None,
        *,
        trace: bool = False,
        log_level: str = "WARNING",
        core_threads: int | None = None,  # None: core_process.core_threads decides
    ) -> EngineClient:
        """Start the engine core process and wait until it has loaded the model. Raises
        EngineStartError (core_process.py) with the core's message when loading fails."""
        core = spawn_core(
            config, max_queue, trace=trace, log_level=log_level, core_threads=core_threads
        )
        return cls(core.channel, core.info, core.tokenizer, join_core=core.join)

    # --- the front end's side (the event loop) ------------------------------------------------
    def start(self) -> None:
        """Attach to the running event loop (and start an in-process core)."""
        self._loop = asyncio.get_running_loop()
        self.outbox.attach(self._loop)
        if self._start_core is not None:
            self._start_core()
            self._start_core = None
        if self.outbox.closed is None:
            self._loop.add_reader(self.channel.fileno(), self._on_frames)
            self.watchdog.start(self._loop)

    @property
    def alive(self) -> bool:
        return self.outbox.closed is None and not self._stop_sent

    @property
    def stalled(self) -> str | None:
        """Why the core seems stuck (step_watchdog.py); None while it answers."""
        return self.watchdog.stalled

    def check_free(self, request_id: str) -> None:
        """Raise ValueError while a request submitted as or under (`group`) this id runs:
        its answers would reach the running request's handler, the other hang."""
        if self._open.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    async def submit(
        self, request_id: str, request_args: dict, params: SamplingParams, group: str | None = None
    ):
        """Add a request (request_args: {"prompt_ids": [...]}) once the core has admitted it.
        group: the id of the request of several prompts this one is a part of, in use until
        all its parts have ended (its submitter checks it free before the first part).
        Raises RequestRejected (too long), QueueFull, ValueError / TypeError (the core's
        refusal, an id in use), EngineUnavailable."""
        if not self.alive:
            raise EngineUnavailable(self.outbox.closed or "the server is shutting down")
        if self.stalled is not None:
            raise EngineUnavailable(self.stalled)
        self.check_free(request_id)
        eos = () if params.ignore_eos else self.tokenizer.stop_token_ids
        stop_ids = frozenset(params.stop_token_ids).union(eos)
        stream = RequestStream(
            request_id, params, stop_ids, self.tokenizer, abort=self.abort, record=self.record,
            context=tuple(request_args["prompt_ids"][-CONTEXT_IDS:]),
        )  # fmt: skip
        admitted = self._loop.create_future()
        self._open.add(request_id, (admitted, stream), group)
        self.outbox.add(AddRequest(request_id, list(request_args["prompt_ids"]), params))
        try:
            await admitted
        except asyncio.CancelledError:
            self._open.drop(request_id)  # its answer is nobody's now
            self.abort(request_id)  # sent after the add: the core frees what it took
            raise
        return stream

    def abort(self, request_id: str, alone: bool = False) -> None:
        """Tell the core to abort an engine request id (`alone`: Abort's)."""
        with contextlib.suppress(EngineUnavailable):
            self.outbox.send(Abort(request_id, alone))

    async def current_gauges(self) -> EngineGauges | None:
        """The core's gauges (asked for; the last reading once it has stopped)."""
        if self.alive and self.stalled is None:  # (a stalled core answers nothing)
            query = next(self._ids)
            self._queries[query] = self._loop.create_future()
            with contextlib.suppress(EngineUnavailable):
                self.outbox.send(StatsQuery(query))
                await self._queries[query]
        return self._last_gauges

    def request_stop(self) -> None:
        """Ask the core to abort every request (their streams end with "abort") and stop."""
        if not self._stop_sent:
            self._stop_sent = True
            with contextlib.suppress(EngineUnavailable):
                self.outbox.send(Stop())

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """request_stop(), then wait for the core to end (from any thread but the loop's)."""
        self.request_stop()
        if self._join_core is not None:
            self._join_core(timeout)

    async def aclose(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """stop() from the event loop: messages (the aborts' finals) keep arriving meanwhile."""
        self.request_stop()
        if self._join_core is not None:
            await asyncio.to_thread(self._join_core, timeout)
        self._on_frames()  # what came last (the Dead message)

    def _stalled(self) -> None:
        """The core has just been marked stalled: /metrics answers with the last gauges."""
        for future in self._queries.values():
            if not future.done():
                future.set_result(None)
        self._queries.clear()
        self._notify()

    def _fail_stalled(self, silent: float) -> None:
        """Fail and abort every open request: the core has not stepped for too long."""
        if not self._open:
            return
        reason = f"the engine has completed no step in {silent:.0f} s; the request was aborted"
        log.error("%s requests fail: %s", len(self._open), reason)
        failure = EngineUnavailable(reason)
        admitting, streams = self._open.take_all()
        for request_id, (future, _) in admitting.items():
            if not future.done():
                future.set_exception(failure)
            self.abort(request_id)  # (after its add: a core that wakes up frees it)
        for stream in streams:
            stream.fail(failure)
        self._notify()

    def _on_frames(self) -> None:
        now = time.monotonic()
        self.watchdog.heard(now)
        try:
            while self.outbox.closed is None and self.channel.poll(0):
                self._handle(self.channel.recv(), now)
        except (EOFError, OSError):
            self._dead("the engine core has stopped")
        except ValueError as exc:  # not a message: the core is broken
            log.error("the engine core sent %s", exc)
            self._dead("the engine core has stopped")
        self._notify()

    def _handle(self, message: CoreMessage, now: float) -> None:
        handler = self._handlers.get(type(message))
        if handler is not None:
            handler(message, now)
        else:
            log.error("the engine core sent a message the front end does not take: %r", message)

    def _step_outputs(self, message: StepOutputs, now: float) -> None:
        streams, itls = self._open.streams, []
        for key, token in zip(message.request_ids, message.token_ids):  # plain decode tokens
            stream = streams.get(key)
            if stream is not None:
                out = stream.take_token(token, now, itls)
                if out is not None:
                    stream.put(out)
        if itls:
            self.metrics.later_tokens(itls)
        for delta in message.outputs:
            stream = streams.get(delta.key)
            if stream is None:
                continue
            out = stream.take(delta, now)
            if stream.pending == 0:
                self._open.finished(delta.key)
            if out is not None:
                stream.put(out)

    def _added(self, message: Added, _now: float) -> None:
        entry = self._open.admitted(message.request_id)
        if entry is None:  # failed by the watchdog, since aborted
            return
        future, stream = entry
        stream.prompt_tokens = message.prompt_tokens
        self.metrics.request_added(stream.prompt_tokens)
        if not future.done():
            future.set_result(stream)

    def _refused(self, message: Refused, _now: float) -> None:
        entry = self._open.drop(message.request_id)
        if entry is None:  # failed by the watchdog
            return
        future, code = entry[0], message.code
        self.metrics.request_rejected(code if code != "error" else "invalid")
        if not future.done():
            future.set_exception(refusal(code, message.message))

    def _unsendable(self, request_id: str, reason: str) -> None:
        """The outbox could not encode this request's add: refused as invalid (a 400)."""
        self._refused(Refused(request_id, "invalid", reason), 0.0)

    def _stats(self, message: Stats, _now: float) -> None:
        self._last_gauges = message.gauges
        future = self._queries.pop(message.query_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _dead_message(self, message: Dead, _now: float) -> None:
        if message.gauges is not None:
            self._last_gauges = message.gauges
        self._dead(message.reason)

    def _dead(self, reason: str) -> None:
        if self.outbox.closed is not None:
            return
        failing = not self._stop_sent
        self.outbox.close(reason)
        if self._loop is not None:
            self._loop.remove_reader(self.channel.fileno())
        self.watchdog.stop()
        self.channel.close()  # (an in-process core's reader then sees EOF and ends)
        failure = EngineUnavailable(reason)
        admitting, streams = self._open.take_all()
        for future, _ in admitting.values():
            if not future.done():
                future.set_exception(failure)
        for future in self._queries.values():
            if not future.done():
                future.set_result(None)
        for stream in streams:
            stream.put(failure)
        self._queries.clear()
        if failing:
            log.error("%s; no more requests will be served", reason)
            if self.on_dead is not None:
                self.on_dead(reason)

    def _notify(self) -> None:
        with self._changed:
            self.num_live = len(self._open.streams)
            self._changed.notify_all()

    def record(self, stream: RequestStream, sample: Sample, out: StreamOutput, now: float) -> None:
        if out.token_ids:
            first = sample.last_token is None
            ttft = now - stream.arrival if first else None
            itl = None if first else now - sample.last_token
            self.metrics.tokens(len(out.token_ids), ttft, itl)
        if out.finished:
            self.metrics.request_finished(out.finish_reason.value, now - stream.arrival)

    # --- any thread (tests and tools) ----------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until predicate() holds, re-checked after every batch of frames (e.g.
        `lambda: client.num_live == 0`). False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)
