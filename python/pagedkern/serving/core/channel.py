"""The wire between the HTTP front end and the engine core: msgpack frames over one duplex
`multiprocessing` connection (a Unix socket pair). A frame is a list `[kind, *fields]` of ints,
floats, strings, None, lists and maps; `pack` refuses anything else (msgpack raises TypeError
for a Python object: there is no `default` hook and no pickle anywhere on this path).

Front end -> core (`FrontFrame`):
    [ADD, [[request_id, prompt_ids, sampling_fields], ...]]   the requests submitted in one
                                      event-loop iteration; sampling fields: SamplingParams'
                                      non-default fields as plain values, `stop` left out
    [ABORT, request_id]                              an engine request id (a sample's: "id.i")
    [STATS, query_id]                                -> [STATS, query_id, gauges]
    [CALL, call_id]                                  in-process cores only: a test's function
    [STOP]                                           abort everything, answer, exit
Core -> front end (`CoreFrame`):
    [READY, info]                                    once, after loading (info: a map)
    [FAILED, message]                                loading failed; the core exits
    [ADDED, request_id, prompt_tokens] / [REFUSED, request_id, code, message]
    [OUTPUTS, [[key, index, token_ids, finish, error, logprobs, prompt], ...],
     [request_id, ...], [token_id, ...]]            one per step; the two columns: the plain
                                      decodes' tokens that end nothing (sample 0, nothing else
                                      to say); a request is in one of the two parts at most
    [STATS, query_id, gauges] / [CALLED, call_id]
    [DEAD, reason, gauges]                           the core stopped (gauges: its last reading)
finish: None or a FinishReason value; logprobs: None or [[token, logprob, [[id, lp], ...]], ...];
prompt: None or [prompt token ids, [None or [token, logprob, [[id, lp], ...]], ...]] (echo +
logprobs: with the finishing delta);
gauges: metrics.EngineGauges' fields in order (engine_core.gauges makes the list) or None.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

import msgpack

ADD, ABORT, STATS, CALL, STOP = "add", "abort", "stats", "call", "stop"
READY, FAILED, ADDED, REFUSED, OUTPUTS, CALLED, DEAD = (
    "ready",
    "failed",
    "added",
    "refused",
    "outputs",
    "called",
    "dead",
)


def pack(frame: list) -> bytes:
    """A frame's bytes; TypeError for anything that is not plain msgpack data."""
    return msgpack.packb(frame, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Channel:
    """One end of the connection; `send` is safe from any thread (one frame at a time)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._sending = threading.Lock()

    def send(self, *frame) -> None:
        data = pack(list(frame))
        with self._sending:
            self.conn.send_bytes(data)

    def recv(self) -> list:
        """The next frame; EOFError when the other end has closed."""
        return unpack(self.conn.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
