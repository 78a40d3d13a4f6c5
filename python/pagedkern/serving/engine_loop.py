"""One thread owns the engine; asyncio handlers talk to it through a command queue.

The engine is not thread-safe, so exactly one thread (`pagedkern-engine`) touches it. Handlers
(on the server's event loop) put closures on a thread-safe FIFO queue: add a request, abort
one, run a function against the engine. The thread drains the queue, runs one engine step
(continuous batching over every live request), and hands each step's outputs back to the event
loop in one `loop.call_soon_threadsafe`, which files them into per-request asyncio queues.
While no request is live the thread blocks on the queue (no spinning).

Cancellation: `RequestStream.close()` (the handler's `finally`: client gone, or the server
shutting down) queues an abort when the request has not finished; the thread runs it before
its next step and the engine gives the request's KV blocks back at once.

Backpressure: an add is refused with QueueFull when `max_queue` requests would already be
waiting after the next schedule filled the free batch slots
(waiting - (max_num_seqs - running) >= max_queue): only requests that must really queue count,
so a burst that fits in the batch is never refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine, RequestOutput, RequestRejected, SamplingParams
from .metrics import EngineGauges, ServerMetrics

log = logging.getLogger("pagedkern.serving")


class QueueFull(Exception):
    """Too many requests are waiting (-> HTTP 429)."""


class EngineUnavailable(Exception):
    """The engine thread has stopped (shut down, or died on an unexpected error) (-> 503)."""


@dataclass(eq=False)
class RequestStream:
    """The handler's end of one request: outputs arrive in `queue` (on the handler's loop)."""

    request_id: str
    owner: EngineLoop
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    finished: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    samples: int = 1  # n > 1: outputs of every sample (out.index), finished when all are
    _open: int = 0  # samples not finished, as the handler has seen them
    pending: int = 1  # samples not finished, as the engine thread has delivered them

    async def outputs(self):
        """RequestOutputs until the last sample's finished one; raises EngineUnavailable if the
        engine dies."""
        self._open = self._open or self.samples
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self._open -= item.finished
            self.finished = self._open == 0
            yield item

    def close(self) -> None:
        """Abort the request unless it finished (idempotent; safe from any thread)."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        max_queue: int | None = None,  # None: engine.config.max_queue
        metrics: ServerMetrics | None = None,
        after_step: Callable[[Engine], None] | None = None,
    ):
        self.engine = engine  # touched only by the engine thread once started
        self.max_queue = engine.config.max_queue if max_queue is None else max_queue
        self.metrics = metrics or ServerMetrics()
        self.after_step = after_step  # test hook, runs in the engine thread after every step
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _closed against enqueue-after-exit
        self._closed: str | None = None  # why no command will run any more
        self._changed = threading.Condition()  # notified after every loop iteration
        self.num_live = 0  # requests admitted and not finished (updated by the engine thread)
        self._last_gauges: EngineGauges | None = None
        self._thread = threading.Thread(target=self._run, name="pagedkern-engine", daemon=True)

    # --- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive() and self._closed is None:
            self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to abort every live request (their streams end with finish reason
        "abort") and end; returns at once."""
        if not self._thread.is_alive():
            with self._lock:
                self._closed = self._closed or "the engine loop is not running"
        self._put(None, quiet=True)

    def stop(self, timeout: float = 30.0) -> None:
        """request_stop(), then wait for the thread to end."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._closed is None

    def abort(self, request_id: str) -> None:
        self._put(lambda: self._deliver(*self._abort(request_id)), quiet=True)

    def _abort(self, request_id: str) -> list:
        """The request's (and, n > 1, its samples') final outputs."""
        return [self.engine.abort(request_id), *self.engine.pop_undelivered()]

    async def submit(self, request_id: str, request_args: dict, params: SamplingParams):
        """Add a request; returns its RequestStream once the engine admitted it. Raises
        ValueError (empty prompt), RequestRejected (too long), QueueFull, EngineUnavailable, or
        whatever else add_request raised (e.g. a chat template's TemplateError)."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        admitted = loop.create_future()
        self._put(lambda: self._add(stream, request_args, params, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: runs after it, frees what it took
            raise
        return stream

    def run_in_engine(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """fn(engine) in the engine thread, between two steps; a Future of its result (from
        any thread; `call` is the asyncio form)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

        self._put(run)
        return future

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.run_in_engine(fn))

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until predicate() holds, re-checked after every engine-loop iteration (for
        tests and tools: e.g. `lambda: loop.num_live == 0`). False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    async def current_gauges(self) -> EngineGauges | None:
        """The engine's gauges: read in the engine thread while it runs; read directly once it
        has ended (nothing else touches the engine then), so a dead engine's /metrics still
        shows what it held; the last reading while it is shutting down."""
        if self._thread.is_alive():
            with contextlib.suppress(EngineUnavailable):
                self._last_gauges = await self.call(lambda _engine: self.gauges())
        else:
            try:
                self._last_gauges = self.gauges()
            except Exception:  # noqa: BLE001 - a broken engine: keep the last reading
                log.debug("reading a stopped engine's gauges failed", exc_info=True)
        return self._last_gauges

    def gauges(self) -> EngineGauges:
        """Engine-thread only (pass to `call`), or once the engine thread has ended."""
        s = self.engine.stats()
        return EngineGauges(
            s.num_running,
            s.num_waiting,
            s.num_blocks_used,
            s.num_blocks_total,
            s.num_spec_steps,
            s.num_spec_proposed,
            s.num_spec_accepted,
        )

    def _put(self, command: Callable[[], None] | None, quiet: bool = False) -> None:
        with self._lock:
            if self._closed is None:
                self._commands.put(command)
                return
            reason = self._closed
        if not quiet and command is not None:
            raise EngineUnavailable(reason)

    # --- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished
                command = self._commands.get() if block else _get_nowait(self._commands)
                while command is not _EMPTY:
                    if command is None:
                        self._shutdown("the server is shutting down")
                        return
                    command()
                    command = _get_nowait(self._commands)
                if engine.has_unfinished:
                    self._deliver(*engine.step())
                    if self.after_step is not None:
                        self.after_step(engine)
                self._notify()
        except BaseException as exc:
            log.exception("the engine thread failed; no more requests will be served")
            self._shutdown("the engine stopped after an internal error", exc)

    def _add(self, stream: RequestStream, args: dict, params: SamplingParams, admitted) -> None:
        if self._closed is not None:
            return _settle(stream.loop, admitted, None, EngineUnavailable(self._closed))
        stats = self.engine.stats()
        free_slots = max(0, stats.max_num_seqs - stats.num_running)
        if stats.num_waiting - free_slots >= self.max_queue:
            self.metrics.request_rejected("queue_full")
            error = QueueFull(f"{stats.num_waiting} requests are already waiting")
            return _settle(stream.loop, admitted, None, error)
        try:
            request = self.engine.add_request(params=params, request_id=stream.request_id, **args)
        except Exception as exc:  # noqa: BLE001 - the request's fault (or not): the loop lives on
            code = "context_length_exceeded" if isinstance(exc, RequestRejected) else "invalid"
            self.metrics.request_rejected(code)
            return _settle(stream.loop, admitted, None, exc)
        stream.prompt_tokens = len(request.prompt_ids)
        stream.samples = stream.pending = params.n
        self._streams[stream.request_id] = stream
        self.metrics.request_added(stream.prompt_tokens)
        _settle(stream.loop, admitted, stream, None)

    def _deliver(self, *outputs: RequestOutput | None) -> None:
        """Record metrics and hand the outputs to their streams' loops, one wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            if out is None:
                continue
            key = out.parent_id or out.request_id  # n > 1: every sample goes to one stream
            stream = self._streams.get(key)
            if stream is None:
                continue
            self._record(stream, out)
            if out.finished:
                stream.pending -= 1
                if stream.pending == 0:
                    del self._streams[key]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _file, items)

    def _record(self, stream: RequestStream, out: RequestOutput) -> None:
        m = out.metrics
        if out.token_ids:
            first = m.num_output_tokens == 1
            ttft = m.first_token_time - stream.arrival if first else None
            itl = None if first else m.last_itl
            self.metrics.tokens(len(out.token_ids), ttft, itl)
        if out.finished:
            latency = (m.finish_time or time.monotonic()) - stream.arrival
            self.metrics.request_finished(out.finish_reason.value, latency)

    def _shutdown(self, reason: str, error: BaseException | None = None) -> None:
        with self._lock:
            self._closed = reason
        pending = []
        while (command := _get_nowait(self._commands)) is not _EMPTY:
            pending.append(command)
        for command in pending:  # aborts and calls still run; adds find the engine closed
            if command is not None:
                try:
                    command()
                except Exception:  # noqa: BLE001 - a broken engine: keep closing the rest
                    log.exception("a command failed during shutdown")
        if error is None:
            for request_id in list(self._streams):
                self._deliver(*self._abort(request_id))
        failure = EngineUnavailable(reason)
        for stream in self._streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, failure)
        self._streams.clear()
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self.num_live = len(self._streams)
            self._changed.notify_all()


_EMPTY = object()


def _get_nowait(q: queue.SimpleQueue):
    try:
        return q.get_nowait()
    except queue.Empty:
        return _EMPTY


def _file(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)


def _settle(loop, future: asyncio.Future, value, error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():  # the handler was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    _call_soon(loop, settle)
