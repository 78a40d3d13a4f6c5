"""The front end's messages to the engine core, in order.

Adds go out as one Add message per event-loop iteration: a burst of requests parsed in the
same iteration reaches the core together, to be admitted before one step (the offline engine
gets its whole batch at once; one frame per request let the core step the first ones alone
while the rest were still on their way). Any other message goes out at once, after the adds
queued before it when sent from the loop's thread, so an abort never overtakes its request's
add. An Add that cannot be encoded (a field msgpack cannot carry, such as an integer past 64
bits in a schema) goes out request by request instead, and each request that still cannot is
refused to its client (`refuse`): one bad request never takes the others in its Add with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from .channel import Channel, encode
from .client_errors import EngineUnavailable
from .messages import Add, AddRequest, FrontMessage


class CoreOutbox:
    def __init__(self, channel: Channel, refuse: Callable[[str, str], None]):
        self.channel = channel
        self.refuse = refuse  # (request id, why): an add that cannot be sent
        self.closed: str | None = None  # why nothing more goes out (the core has gone)
        self._adds: list[AddRequest] = []  # for this loop iteration's Add
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on `loop` (called from its thread)."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def add(self, add: AddRequest) -> None:
        """Queue an add for this loop iteration's Add (on the loop's thread)."""
        if self.closed is not None:
            raise EngineUnavailable(self.closed)
        self._adds.append(add)
        if len(self._adds) == 1:
            self._loop.call_soon(self._flush_adds)

    def send(self, message: FrontMessage) -> None:
        """Send a message, after the adds queued before it (from the loop's thread)."""
        if self._adds and threading.get_ident() == self._loop_thread:
            self._flush_adds()
        self._send_now(message)

    def close(self, reason: str) -> None:
        """Nothing more goes out; queued adds are dropped (the client fails their requests)."""
        self.closed = reason
        self._adds.clear()

    def _flush_adds(self) -> None:
        adds, self._adds = self._adds, []
        if adds and self.closed is None:
            self._send_adds(adds)

    def _send_adds(self, adds: list[AddRequest]) -> None:
        try:
            data = encode(Add(adds))
        except (TypeError, ValueError, OverflowError) as exc:
            if len(adds) == 1:
                self.refuse(adds[0].request_id, f"the request cannot be sent to the engine: {exc}")
            else:
                for add in adds:
                    self._send_adds([add])
            return
        with contextlib.suppress(EngineUnavailable):  # (the client fails their futures)
            self._send_frame(data)

    def _send_now(self, message: FrontMessage) -> None:
        self._send_frame(encode(message))

    def _send_frame(self, data: bytes) -> None:
        if self.closed is not None:
            raise EngineUnavailable(self.closed)
        try:
            self.channel.send_frame(data)
        except (OSError, ValueError) as exc:  # the core's end is gone
            raise EngineUnavailable("the engine core has stopped") from exc
