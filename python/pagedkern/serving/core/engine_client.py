"""The front end's handle on the engine core (engine_core.py): requests out, token deltas in.

Messages (messages.py) arrive on the event loop itself (`loop.add_reader` on the channel's
socket): each StepOutputs is fanned out to the per-request streams in one pass, no thread hop.
Text is made here: every sample has its own IncrementalDetokenizer with the request's stop
strings; when one matches, the sample finishes with "stop" and the core is told to abort it
(tokens it made in the meantime are dropped; n > 1: the first sample cannot be aborted alone, so
it runs on to its end and what it makes is dropped).
Stop token ids, EOS and max_tokens stay in the core.

Two ways to have a core: `EngineClient.spawn(config)` starts the core process (the server),
`EngineClient.in_thread(engine)` runs a core on a thread of this process over the same
messages (notebooks and tests).

Cancellation: `RequestStream.close()` (the handler's `finally`: client gone, or the server
shutting down) sends an abort unless the core has finished every sample; the core runs it before
its next step and gives the KV blocks back. A stream leaves `num_live` once the core has
answered its last sample's finish.

A core that goes away (EOF, or a Dead message) fails every open stream with EngineUnavailable
(-> an error event or a 503) and calls `on_dead` (the server then exits non-zero).

A core that stops answering (stopped, or stuck in a step, e.g. on a stopped TP worker) is
found by a watchdog on the loop: no message for `step_timeout` seconds while the core owes one
(an open request, an admission, a stats query) sets `stalled` (/health 503, new requests 503,
/metrics answers with the last gauges); after `stalled_request_timeout` seconds the open
requests fail with EngineUnavailable and are aborted. The core sends a message at least every
HEARTBEAT_S of stepping (engine_core.py), so a long prefill is not a stall; its next message
clears `stalled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

from ...engine import Engine, EngineConfig, RequestRejected, SamplingParams
from ...model.tokenizer import Tokenizer
from .channel import Channel
from .engine_core import EngineCore, core_info, core_process
from .messages import (
    Abort,
    Add,
    Added,
    AddRequest,
    CoreInfo,
    CoreMessage,
    Dead,
    EngineGauges,
    Failed,
    FrontMessage,
    Refused,
    Stats,
    StatsQuery,
    StepOutputs,
    Stop,
)
from .metrics import ServerMetrics
from .request_stream import RequestStream, Sample, StreamOutput

log = logging.getLogger("pagedkern.serving")
STARTUP_TIMEOUT_S = 600.0  # loading a big model from a cold disk
STOP_TIMEOUT_S = 30.0


class QueueFull(Exception):
    """Too many requests are waiting (-> HTTP 429)."""


class EngineUnavailable(Exception):
    """The engine core has stopped (shut down, or died) (-> 503)."""


class EngineStartError(RuntimeError):
    """The engine core could not load (the message says why, e.g. an unknown model)."""


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
        self._streams: dict[str, RequestStream] = {}
        self._admitting: dict[str, tuple[asyncio.Future, RequestStream]] = {}
        self._adds: list[AddRequest] = []  # not yet sent (see _queue_add)
        self._loop_thread: int | None = None
        self._queries: dict[int, asyncio.Future] = {}
        self._closed: str | None = None  # why no frame will be answered any more
        self._stop_sent = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = threading.Condition()  # notified after every batch of messages
        self.num_live = 0  # streams the core has not finished
        self._last_gauges: EngineGauges | None = None
        # the step watchdog (see the module's docstring); the server sets the two bounds
        self.step_timeout = 60.0
        self.stalled_request_timeout = 120.0
        self.stalled: str | None = None  # why the core seems stuck; None while it answers
        self._last_frame = time.monotonic()
        self._owed_since: float | None = None  # since when the core owes a message
        self._watchdog: asyncio.TimerHandle | None = None
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
        core_threads: int | None = None,  # None: engine_core.core_threads decides
    ) -> EngineClient:
        """Start the engine core process and wait until it has loaded the model. Raises
        EngineStartError with the core's message when loading fails."""
        context = multiprocessing.get_context("spawn")
        front, back = context.Pipe()
        folder = tempfile.mkdtemp(prefix="pagedkern-tokenizer-")
        process = context.Process(
            target=core_process,
            args=(config, back, folder, max_queue, trace, log_level, core_threads),
            name="pagedkern-engine-core",
        )
        process.start()
        back.close()  # the child holds it now: its exit is our EOF
        channel = Channel(front)
        try:
            if not channel.poll(STARTUP_TIMEOUT_S):
                raise EngineStartError(f"the engine core did not start in {STARTUP_TIMEOUT_S:g} s")
            try:
                ready = channel.recv()
            except EOFError:
                process.join(5)
                message = f"the engine core exited while loading (exit code {process.exitcode})"
                raise EngineStartError(message) from None
            if isinstance(ready, Failed):
                raise EngineStartError(ready.message)
            tokenizer = Tokenizer.from_folder(folder)
        except BaseException:
            process.kill()
            process.join()
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)

        reported = []

        def join(timeout: float) -> None:
            process.join(timeout)
            if process.exitcode is None:
                log.error("the engine core did not stop in %g s: killing it", timeout)
                process.kill()
                process.join()
            elif process.exitcode != 0 and not reported:  # (join runs twice at shutdown)
                reported.append(process.exitcode)
                code = process.exitcode
                how = f"signal {-code}" if code < 0 else f"status {code}"
                log.error("the engine core exited with %s", how)

        return cls(channel, ready.info, tokenizer, join_core=join)

    # --- the front end's side (the event loop) ------------------------------------------------
    def start(self) -> None:
        """Attach to the running event loop (and start an in-process core)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if self._start_core is not None:
            self._start_core()
            self._start_core = None
        if self._closed is None:
            self._loop.add_reader(self.channel.fileno(), self._on_frames)
            self._watch()

    @property
    def alive(self) -> bool:
        return self._closed is None and not self._stop_sent

    async def submit(self, request_id: str, request_args: dict, params: SamplingParams):
        """Add a request (request_args: {"prompt_ids": [...]}) once the core has admitted it.
        Raises RequestRejected (too long), QueueFull, ValueError / TypeError (the core's
        refusal), EngineUnavailable."""
        if not self.alive:
            raise EngineUnavailable(self._closed or "the server is shutting down")
        if self.stalled is not None:
            raise EngineUnavailable(self.stalled)
        eos = () if params.ignore_eos else self.tokenizer.stop_token_ids
        stop_ids = frozenset(params.stop_token_ids).union(eos)
        stream = RequestStream(
            request_id, params, stop_ids, self.tokenizer, abort=self.abort, record=self.record
        )
        admitted = self._loop.create_future()
        self._admitting[request_id] = (admitted, stream)
        self._queue_add(AddRequest(request_id, list(request_args["prompt_ids"]), params))
        try:
            await admitted
        except asyncio.CancelledError:
            self._admitting.pop(request_id, None)  # its answer is nobody's now
            self.abort(request_id)  # sent after the add: the core frees what it took
            raise
        return stream

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineUnavailable):
            self._send(Abort(request_id))

    async def current_gauges(self) -> EngineGauges | None:
        """The core's gauges (asked for; the last reading once it has stopped)."""
        if self.alive and self.stalled is None:  # (a stalled core answers nothing)
            query = next(self._ids)
            self._queries[query] = self._loop.create_future()
            with contextlib.suppress(EngineUnavailable):
                self._send(StatsQuery(query))
                await self._queries[query]
        return self._last_gauges

    def request_stop(self) -> None:
        """Ask the core to abort every request (their streams end with "abort") and stop."""
        if not self._stop_sent:
            self._stop_sent = True
            with contextlib.suppress(EngineUnavailable):
                self._send(Stop())

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

    def _queue_add(self, add: AddRequest) -> None:
        """Adds go out as one Add message per event-loop iteration: a burst of requests parsed in
        the same iteration reaches the core together, to be admitted before one step (the
        offline engine gets its whole batch at once; one frame per request let the core step
        the first ones alone while the rest were still on their way)."""
        if self._closed is not None:
            raise EngineUnavailable(self._closed)
        self._adds.append(add)
        if len(self._adds) == 1:
            self._loop.call_soon(self._flush_adds)

    def _flush_adds(self) -> None:
        adds, self._adds = self._adds, []
        if adds and self._closed is None:
            with contextlib.suppress(EngineUnavailable):  # (_dead fails their futures)
                self._send_now(Add(adds))

    def _send(self, message: FrontMessage) -> None:
        """Send a message, after the adds queued before it (on the loop's thread: an abort never
        overtakes its request's add)."""
        if self._adds and threading.get_ident() == self._loop_thread:
            self._flush_adds()
        self._send_now(message)

    def _send_now(self, message: FrontMessage) -> None:
        if self._closed is not None:
            raise EngineUnavailable(self._closed)
        try:
            self.channel.send(message)
        except (OSError, ValueError) as exc:  # the core's end is gone
            raise EngineUnavailable("the engine core has stopped") from exc

    def _watch(self) -> None:
        """The step watchdog's tick (every second or less, on the loop)."""
        self._watchdog = None
        if self._closed is not None:
            return
        now = time.monotonic()
        if not (self._streams or self._admitting or self._queries):
            self._owed_since = None
        else:
            if self._owed_since is None:
                self._owed_since = now
            silent = now - max(self._owed_since, self._last_frame)
            if silent >= self.step_timeout and self.stalled is None:
                self.stalled = f"the engine has completed no step in {silent:.0f} s"
                log.error("%s while requests wait: /health answers 503", self.stalled)
                for future in self._queries.values():  # /metrics: the last gauges
                    if not future.done():
                        future.set_result(None)
                self._queries.clear()
                self._notify()
            if silent >= self.stalled_request_timeout and (self._streams or self._admitting):
                self._fail_stalled(silent)
        interval = min(1.0, self.step_timeout / 4, self.stalled_request_timeout / 4)
        self._watchdog = self._loop.call_later(interval, self._watch)

    def _fail_stalled(self, silent: float) -> None:
        """Fail and abort every open request: the core has not stepped for too long."""
        reason = f"the engine has completed no step in {silent:.0f} s; the request was aborted"
        log.error("%s requests fail: %s", len(self._streams) + len(self._admitting), reason)
        failure = EngineUnavailable(reason)
        for request_id, (future, _) in self._admitting.items():
            if not future.done():
                future.set_exception(failure)
            self.abort(request_id)  # (after its add: a core that wakes up frees it)
        for stream in self._streams.values():
            stream.fail(failure)
        self._admitting.clear()
        self._streams.clear()
        self._notify()

    def _on_frames(self) -> None:
        now = self._last_frame = time.monotonic()
        if self.stalled is not None:
            log.warning("the engine core answers again")
            self.stalled = None
        try:
            while self._closed is None and self.channel.poll(0):
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
        streams, itls = self._streams, []
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
                del self._streams[delta.key]
            if out is not None:
                stream.put(out)

    def _added(self, message: Added, _now: float) -> None:
        if message.request_id not in self._admitting:  # failed by the watchdog, since aborted
            return
        future, stream = self._admitting.pop(message.request_id)
        stream.prompt_tokens = message.prompt_tokens
        self._streams[stream.request_id] = stream
        self.metrics.request_added(stream.prompt_tokens)
        if not future.done():
            future.set_result(stream)

    def _refused(self, message: Refused, _now: float) -> None:
        if message.request_id not in self._admitting:  # failed by the watchdog
            return
        future, _ = self._admitting.pop(message.request_id)
        code = message.code
        self.metrics.request_rejected(code if code != "error" else "invalid")
        if not future.done():
            future.set_exception(_refusal(code, message.message))

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
        if self._closed is not None:
            return
        failing = not self._stop_sent
        self._closed = reason
        if self._loop is not None:
            self._loop.remove_reader(self.channel.fileno())
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.channel.close()  # (an in-process core's reader then sees EOF and ends)
        failure = EngineUnavailable(reason)
        for future, _ in self._admitting.values():
            if not future.done():
                future.set_exception(failure)
        for future in self._queries.values():
            if not future.done():
                future.set_result(None)
        for stream in self._streams.values():
            stream.put(failure)
        self._admitting.clear()
        self._adds.clear()
        self._queries.clear()
        self._streams.clear()
        if failing:
            log.error("%s; no more requests will be served", reason)
            if self.on_dead is not None:
                self.on_dead(reason)

    def _notify(self) -> None:
        with self._changed:
            self.num_live = len(self._streams)
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


def _refusal(code: str, message: str) -> Exception:
    if code == "queue_full":
        return QueueFull(message)
    if code == "context_length_exceeded":
        return RequestRejected(message)
    if code == "invalid":
        return ValueError(message)
    return RuntimeError(message)
