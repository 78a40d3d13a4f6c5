"""The front end's step watchdog: it finds an engine core that stops answering (stopped, or
stuck in a step, e.g. on a stopped TP worker) while the core owes a message (an open request,
an admission, a stats query).

No message for `step_timeout` seconds while one is owed marks the core `stalled` (/health 503,
new requests 503, /metrics answers with the last gauges); after `stalled_request_timeout`
seconds the client fails its open requests. The core sends a message at least every HEARTBEAT_S
of stepping (engine_core.py), so a long prefill is not a stall; its next message clears
`stalled`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("pagedkern.serving")


class StepWatchdog:
    """Ticks on the event loop, every second or less. `owed()`: whether the core owes a message
    now; what a stall does is the client's: `on_stalled()` once the core is marked stalled,
    `on_stalled_too_long(silent seconds)` on every tick past stalled_request_timeout."""

    def __init__(
        self,
        owed: Callable[[], bool],
        on_stalled: Callable[[], None],
        on_stalled_too_long: Callable[[float], None],
    ):
        self.owed, self.on_stalled, self.on_stalled_too_long = owed, on_stalled, on_stalled_too_long
        # the server sets the two bounds (ServerSettings)
        self.step_timeout = 60.0
        self.stalled_request_timeout = 120.0
        self.stalled: str | None = None  # why the core seems stuck; None while it answers
        self._last_message = time.monotonic()
        self._owed_since: float | None = None  # since when the core owes a message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tick()

    def stop(self) -> None:
        """No more ticks (the core has gone)."""
        self._loop = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def heard(self, now: float) -> None:
        """The core sent something at `now`: it answers."""
        self._last_message = now
        if self.stalled is not None:
            log.warning("the engine core answers again")
            self.stalled = None

    def _tick(self) -> None:
        self._timer = None
        now = time.monotonic()
        if not self.owed():
            self._owed_since = None
        else:
            if self._owed_since is None:
                self._owed_since = now
            silent = now - max(self._owed_since, self._last_message)
            if silent >= self.step_timeout and self.stalled is None:
                self.stalled = f"the engine has completed no step in {silent:.0f} s"
                log.error("%s while requests wait: /health answers 503", self.stalled)
                self.on_stalled()
            if silent >= self.stalled_request_timeout:
                self.on_stalled_too_long(silent)
        if self._loop is not None:
            interval = min(1.0, self.step_timeout / 4, self.stalled_request_timeout / 4)
            self._timer = self._loop.call_later(interval, self._tick)
