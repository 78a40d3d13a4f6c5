"""The serving stack inside the test process: `ServerThread` (the HTTP server on a thread, its
engine core on another; `pagedkern-serve --http` runs the core in a process of its own) and
`in_thread` (an EngineClient whose core runs on a thread), with two ways into the core:

- `after_step(engine)`: called by the core after every engine step (HookedCore.step).
- `client.run_in_engine(fn)`: fn(engine) in the core, between two steps, after every message
  sent before it; a Future of its result (`await client.call(fn)` on the event loop). A call
  rides on a StatsQuery with a negative query id (the core answers stats queries in order, and
  the front end's own ids are >= 0): HookedCore runs the call instead of answering it.

    with ServerThread(engine, max_queue=8) as server:
        openai.OpenAI(base_url=server.url + "/v1", api_key="-")...
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from typing import Any

from pagedkern.engine import Engine
from pagedkern.serving.core.channel import Channel
from pagedkern.serving.core.engine_client import EngineClient
from pagedkern.serving.core.engine_core import EngineCore
from pagedkern.serving.core.messages import Message, StatsQuery
from pagedkern.serving.core.metrics import ServerMetrics
from pagedkern.serving.http.app import Server, bind, create_app, url_of
from pagedkern.serving.http.settings import ServerSettings

Call = tuple[Callable[[Engine], Any], concurrent.futures.Future]


class HookedCore(EngineCore):
    """An engine core with the test's hooks: `after_step` and the calls of run_in_engine."""

    def __init__(self, engine, channel: Channel, max_queue=None, after_step=None):
        super().__init__(engine, channel, max_queue)
        self.after_step = after_step
        self.calls: dict[int, Call] = {}  # query id (< 0) -> the call; filled by the client

    def step(self):
        outputs = super().step()
        if self.after_step is not None:
            self.after_step(self.engine)
        return outputs

    def handle(self, message: Message) -> None:
        if type(message) is StatsQuery and message.query_id in self.calls:
            fn, future = self.calls.pop(message.query_id)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            return
        super().handle(message)


class HookedClient(EngineClient):
    """An EngineClient of a HookedCore (made by `in_thread`)."""

    core: HookedCore
    _call_ids = itertools.count(1)

    def run_in_engine(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call = -next(self._call_ids)
        self.core.calls[call] = (fn, future)
        self.outbox.send(StatsQuery(call))
        return future

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.run_in_engine(fn))

    def _dead(self, reason: str) -> None:
        super()._dead(reason)
        for _, future in list(self.core.calls.values()):
            future.cancel()


def in_thread(
    engine: Engine,
    max_queue: int | None = None,
    after_step: Callable[[Engine], None] | None = None,
    metrics: ServerMetrics | None = None,
) -> HookedClient:
    """EngineClient.in_thread with a HookedCore."""
    cores: list[HookedCore] = []

    def make_core(engine, channel, max_queue) -> HookedCore:
        cores.append(HookedCore(engine, channel, max_queue, after_step))
        return cores[-1]

    client = HookedClient.in_thread(engine, max_queue, metrics, make_core=make_core)
    client.core = cores[0]
    return client


class ServerThread:
    """The server in a background thread of this process, its engine core on another thread
    (the engine stays reachable: `engine_loop.run_in_engine`, `after_step`)."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int | None = None,  # None: engine.config.max_queue
        model_name: str | None = None,
        after_step=None,
        settings: ServerSettings | None = None,
    ):
        settings = settings or ServerSettings()
        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.engine_loop = in_thread(engine, max_queue=max_queue, after_step=after_step)
        self.app = create_app(self.engine_loop, model_name, settings)
        self.model_name = self.app.state.model_name
        self.server = Server(self.app, settings)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.sock]},
            name="pagedkern-http",
            daemon=True,
        )

    def start(self) -> ServerThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine_loop.stop()  # in case the lifespan never ran
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
