"""The engine core: the Engine and its step loop, behind the front end's channel (channel.py,
carrying the messages of messages.py).

It runs in its own process under `pagedkern-serve --http` (core_process.py, started by the
front end with multiprocessing's spawn), so the HTTP server's JSON, SSE and detokenization never
hold this process's GIL; in-process cores (`EngineClient.in_thread`: tests, notebooks) run the
same loop on a thread over the same messages.

One reader thread turns incoming messages into an inbox queue, so the front end's sends never
wait for a step to end (and neither side can block the other with both socket buffers full).
The loop drains the inbox (adds, aborts, stats queries), runs one step, and sends everything
the iteration produced as one StepOutputs: per request that advanced, a SampleDelta (its new
token ids, finish, error and logprobs), except that a plain decode's token that ends nothing
travels as a (request id, token) pair in two columns (the engine makes no output object for it:
engine/outputs.TokenDeltas). Text is the front end's business: the engine here does not
detokenize (`Engine.detokenize` off), requests come without stop strings, and the front end
detokenizes, matches stop strings and aborts what one ends. With nothing to do the loop blocks
on the inbox (no spinning).

Backpressure: an add is refused (queue_full) when `max_queue` requests would already wait after
the next schedule filled the free batch slots: waiting - (max_num_seqs - running) >= max_queue
(requests whose grammar compiles count as waiting).

Structured output: a request with a response_format is admitted once its schema has compiled
on the core's GrammarCompilePool (`grammar_compile_workers` threads; llguidance drops the GIL),
so steps go on meanwhile: it is held out of the engine until then (its Added comes then), or
Refused (invalid, naming response_format) when the schema fails or has compiled for longer than
`grammar_compile_timeout`; an abort meanwhile drops it. Each sample's matcher is a copy.

Lifecycle: Stop or the front end's end of the channel closing (the front end exited) aborts every
request and ends the loop; an unexpected exception ends it with a Dead message.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import torch

from ...engine import Engine, RequestOutput, RequestRejected, SamplingParams
from ...engine.outputs import TokenDeltas
from ...engine.structured_output import GrammarCompilePool, PendingGrammar
from .channel import Channel
from .messages import (
    Abort,
    Add,
    Added,
    AddRequest,
    CoreInfo,
    Dead,
    EngineGauges,
    Message,
    Refused,
    SampleDelta,
    Stats,
    StatsQuery,
    StepOutputs,
    Stop,
)

log = logging.getLogger("pagedkern.serving")
_EMPTY = object()
_COMPILED = object()  # an inbox entry: a grammar compile ended (wakes the loop)
COMPILE_POLL_S = 0.25  # while only compiles are pending: how often the loop looks at them
HEARTBEAT_S = 1.0  # at most this long between two StepOutputs while the loop steps


def gauges(engine: Engine) -> EngineGauges:
    s = engine.stats()
    return EngineGauges(
        s.num_running,
        s.num_waiting,
        s.num_blocks_used,
        s.num_blocks_total,
        s.num_spec_steps,
        s.num_spec_proposed,
        s.num_spec_accepted,
        None if engine.shadow is None else engine.shadow.rows(),
        [list(kind) for kind in s.kv_blocks_by_kind] or None,
    )


def core_info(engine: Engine, max_queue: int) -> CoreInfo:
    """What the front end needs to know about the engine, once (in Ready)."""
    return CoreInfo(
        engine.config.model,
        engine.max_model_len,
        engine.model.config.vocab_size,
        max_queue,
        describe(engine),
    )


def describe(engine: Engine) -> str:
    """The engine's --stats line, with the intra-op threads of a CPU engine's steps."""
    if engine.model.device.type != "cpu":
        return engine.describe()
    threads = torch.get_num_threads()
    return f"{engine.describe()}, {threads} CPU thread{'s' if threads > 1 else ''}"


class EngineCore:
    def __init__(
        self,
        engine: Engine,
        channel: Channel,
        max_queue: int | None = None,  # None: engine.config.max_queue
    ):
        self.engine = engine
        # Text is the front end's: the outputs' token ids are all it reads (a --trace still
        # shows the text it narrates)
        engine.detokenize = engine.tracer is not None
        engine.token_deltas = TokenDeltas()  # a plain decode's token: two columns, no object
        self.channel = channel
        self.max_queue = engine.config.max_queue if max_queue is None else max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: list[RequestOutput] = []  # produced outside step() (aborts), sent next
        self.failed = False  # the loop ended on an internal error (the process exits 1)
        self._last_sent = time.monotonic()  # the last StepOutputs
        self._grammars: GrammarCompilePool | None = None  # made at the first response_format
        # requests whose grammar compiles: id -> (its compile, prompt ids, params)
        self._compiling: dict[str, tuple[PendingGrammar, list[int], SamplingParams]] = {}
        self._handlers = {
            Add: self._add_all,
            Abort: self._abort,
            StatsQuery: self._stats,
        }

    def run(self) -> None:
        """Serve messages until Stop or the front end goes away; never raises."""
        threading.Thread(target=self._read, name="pagedkern-core-reader", daemon=True).start()
        try:
            while True:
                message = self._next_message()
                while message is not _EMPTY:
                    if message is None or type(message) is Stop:
                        return self._shutdown(front_end_gone=message is None)
                    self.handle(message)
                    message = _get_nowait(self._inbox)
                if self._compiling:
                    self._admit_compiled()
                stepped = self.engine.has_unfinished
                if stepped:
                    self._outputs += self.step()
                self._flush(stepped or bool(self._compiling))  # (heartbeats while compiling)
        except BaseException:
            self.failed = True
            log.exception("the engine core failed; no more requests will be served")
            self._die("the engine stopped after an internal error")

    def step(self) -> list[RequestOutput]:
        """One engine step (what a subclass wraps to watch the steps)."""
        return self.engine.step()

    def _next_message(self):
        """The next message, without waiting while the engine has work; while only compiles are
        pending, waiting at most COMPILE_POLL_S (their timeouts); else until one comes."""
        if self.engine.has_unfinished:
            return _get_nowait(self._inbox)
        if self._compiling:
            try:
                return self._inbox.get(timeout=COMPILE_POLL_S)
            except queue.Empty:
                return _EMPTY
        return self._inbox.get()

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.recv()
            except (EOFError, OSError):
                self._inbox.put(None)  # the front end closed its end (or exited)
                return
            except ValueError as exc:  # not a message: dropped, the loop goes on
                log.error("the front end sent %s", exc)
                continue
            self._inbox.put(message)

    def handle(self, message: Message) -> None:
        """One message from the front end (or _COMPILED: _admit_compiled looks next)."""
        handler = self._handlers.get(type(message))
        if handler is not None:
            handler(message)
        elif message is not _COMPILED:
            log.error("the front end sent a message the core does not take: %r", message)

    def _add_all(self, message: Add) -> None:
        for request in message.requests:
            self._add(request)

    def _abort(self, message: Abort) -> None:
        if message.request_id in self._compiling:  # not admitted yet: nothing to free
            if message.alone is not True:  # (a first sample alone has made nothing to stop yet)
                del self._compiling[message.request_id]
            return
        aborted = self.engine.abort(message.request_id, alone=message.alone is True)
        self._outputs += [aborted, *self.engine.pop_undelivered()]

    def _stats(self, message: StatsQuery) -> None:
        self.channel.send(Stats(message.query_id, gauges(self.engine)))

    def _add(self, add: AddRequest) -> None:
        request_id, prompt_ids, params = add.request_id, add.prompt_ids, add.params
        stats = self.engine.stats()
        free_slots = max(0, stats.max_num_seqs - stats.num_running)
        waiting = stats.num_waiting + len(self._compiling)
        if waiting - free_slots >= self.max_queue:
            message = f"{waiting} requests are already waiting"
            return self.channel.send(Refused(request_id, "queue_full", message))
        if params is None:
            return self._refuse(request_id, ValueError(add.invalid))
        if request_id in self._compiling:
            return self._refuse(
                request_id, ValueError(f"request id {request_id!r} is already in use")
            )
        if params.response_format is None:
            return self._admit(request_id, prompt_ids, params)
        if self._grammars is None:
            config = self.engine.config
            self._grammars = GrammarCompilePool(
                self.engine.tokenizer, self.engine.vocab_size, config.grammar_compile_workers
            )
        pending = self._grammars.submit(params.response_format)
        if pending.future.done():  # compiled before (or failed before)
            return self._admit_compiled_one(request_id, pending, prompt_ids, params)
        self._compiling[request_id] = (pending, prompt_ids, params)
        pending.future.add_done_callback(lambda _: self._inbox.put(_COMPILED))

    def _admit_compiled(self) -> None:
        """Admit the held requests whose grammar is ready; refuse those whose compile failed
        or has run past grammar_compile_timeout (it runs on; its outcome is cached)."""
        now, timeout = time.monotonic(), self.engine.config.grammar_compile_timeout
        for request_id, (pending, prompt_ids, params) in list(self._compiling.items()):
            if pending.future.done():
                del self._compiling[request_id]
                self._admit_compiled_one(request_id, pending, prompt_ids, params)
            elif pending.running_for(now) > timeout:
                del self._compiling[request_id]
                message = (
                    f"response_format: the schema did not compile within {timeout:g} s "
                    "(--grammar-compile-timeout)"
                )
                log.warning("request %s: %s", request_id, message)
                self.channel.send(Refused(request_id, "invalid", message))

    def _admit_compiled_one(
        self, request_id: str, pending: PendingGrammar, prompt_ids: list[int], params
    ) -> None:
        try:
            grammar = pending.future.result()
        except Exception as exc:  # noqa: BLE001 - the schema's fault (or not): refused
            return self._refuse(request_id, exc)
        self._admit(request_id, prompt_ids, params, grammar)

    def _admit(self, request_id: str, prompt_ids: list[int], params, grammar=None) -> None:
        try:
            request = self.engine.add_request(
                params=params, request_id=request_id, prompt_ids=prompt_ids, grammar=grammar
            )
        except Exception as exc:  # noqa: BLE001 - the request's fault (or not): the loop lives on
            return self._refuse(request_id, exc)
        self.channel.send(Added(request_id, len(request.prompt_ids)))

    def _refuse(self, request_id: str, exc: Exception) -> None:
        if isinstance(exc, RequestRejected):
            code = "context_length_exceeded"
        elif isinstance(exc, (ValueError, TypeError)):
            code = "invalid"
        else:
            log.error("admitting request %s failed", request_id, exc_info=exc)
            code = "error"
        self.channel.send(Refused(request_id, code, str(exc)))

    def _flush(self, stepped: bool = False) -> None:
        """The step's StepOutputs; an empty one after a step that made none when nothing was
        sent for HEARTBEAT_S (a long prefill): the front end's step watchdog hears the loop."""
        outputs = [SampleDelta.of(o) for o in self._outputs if o is not None]
        self._outputs = []
        keys, tokens = self.engine.token_deltas.take()
        now = time.monotonic()
        if outputs or keys or (stepped and now - self._last_sent >= HEARTBEAT_S):
            self._last_sent = now
            self.channel.send(StepOutputs(outputs, keys, tokens))

    def _shutdown(self, front_end_gone: bool) -> None:
        for request_id in list(self.engine.requests):
            if request_id in self.engine.requests:  # (an n > 1 abort ends its samples too)
                self._outputs += [self.engine.abort(request_id), *self.engine.pop_undelivered()]
        if front_end_gone:
            log.info("the front end has gone: the engine core stops")
            return
        with contextlib.suppress(OSError):
            self._flush()
            self.channel.send(Dead("the server is shutting down", gauges(self.engine)))

    def _die(self, reason: str) -> None:
        try:
            reading = gauges(self.engine)
        except Exception:  # noqa: BLE001 - a broken engine: no reading
            reading = None
        with contextlib.suppress(OSError, ValueError):
            self.channel.send(Dead(reason, reading))


def _get_nowait(q: queue.SimpleQueue):
    try:
        return q.get_nowait()
    except queue.Empty:
        return _EMPTY
