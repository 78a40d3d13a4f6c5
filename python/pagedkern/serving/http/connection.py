"""Connection hygiene around the app: bounded request heads and bodies, read timeouts, the
request id, the API key.

- `BoundedH11Protocol`: uvicorn's h11 protocol plus a deadline for a request's head (a client
  that trickles its headers is disconnected after `header_timeout` seconds; uvicorn's own
  keep-alive timer restarts on every byte). The head's size is bounded by uvicorn's
  `h11_max_incomplete_event_size`, the number of connections by `limit_concurrency`. Each
  request's scope carries a `ChunkWriter` (extensions[CHUNK_WRITER]), with which a streamed
  response writes the parts of its chunked body straight to the socket. A connection whose
  writes stay paused (its client takes nothing while
  the response waits in its buffer) for `write_timeout` seconds is aborted: its handler sees a
  disconnect and aborts the request. The end of a client's stream (FIN) is taken for its
  departure, as uvicorn and nginx take it: TCP cannot tell `close()` from a half-close
  (`shutdown(SHUT_WR)`) until a write fails, and a whole (unstreamed) answer writes nothing
  before it is done, so keeping half-closed connections open would let every client that leaves
  keep its generation running to the end. A half-closing client gets no answer.
- `read_body`: the request body, at most `max_bytes` (413) within `timeout` seconds (408).
- `RequestContext`: an ASGI middleware that bounds the head's size (431), reads `X-Request-Id`
  (or makes one), echoes it on the response and checks `Authorization: Bearer <api key>` on the
  /v1 routes (401).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from .errors import APIError

log = logging.getLogger("pagedkern.serving")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class BoundedH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # set per server by a subclass (see `protocol_class`)
    write_timeout: float = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = None
        self._write_deadline = None
        self._arm_head_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_timeout, self._write_too_slow)

    def resume_writing(self) -> None:
        self._cancel_write_deadline()
        super().resume_writing()

    def _cancel_write_deadline(self) -> None:
        if getattr(self, "_write_deadline", None) is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_too_slow(self) -> None:
        self._write_deadline = None
        if self.flow.write_paused:
            log.warning(
                "a client took no data for %g s while its response waited: closing it",
                self.write_timeout,
            )
            self.transport.abort()  # (close() would wait for the buffer to drain)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # (its task has not run yet)
            self.cycle.scope.setdefault("extensions", {})[CHUNK_WRITER] = ChunkWriter(self.cycle)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_head():
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_head_deadline()
        self._cancel_write_deadline()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


CHUNK_WRITER = "pagedkern.chunk_writer"  # scope["extensions"] key: the request's ChunkWriter


class ChunkWriter:
    """Writes the parts of a streamed response's chunked body to its connection itself, beside
    uvicorn's request/response cycle (which it reads, never changes). The measured reason: h11's
    Data event, state machine and writer cost ~4 us a send (an SSE chunk of one token: 4.3 us
    against 0.3 us for this framing, on the 2-core CI host), ~6 us with uvicorn's send and the
    ASGI chain, a third of the per-token front end at 256 streams
    (bench/test_bench_http_frontend.py). The same bytes as h11's chunked framing (`size in hex
    CRLF data CRLF`); h11 keeps no state per chunk, so the head and the end of the message still
    go through the cycle's send.

    For EventStreamResponse (event_stream_response.py), which sets neither Content-Length nor
    Transfer-Encoding: h11 then frames the body chunked exactly when the request was HTTP/1.1
    and not HEAD (an HTTP/1.0 client gets a body delimited by the connection's close, which the
    cycle's send writes; tests pin both). Its parts may come from outside the response's task
    (the engine client's message handler), when `chunk_ready()`."""

    __slots__ = ("cycle", "chunked")

    def __init__(self, cycle: RequestResponseCycle):
        self.cycle = cycle
        scope = cycle.scope
        self.chunked = scope["http_version"] == "1.1" and scope["method"] != "HEAD"

    def chunk_ready(self) -> bool:
        """Whether a body part can be written now, without waiting (chunked, started, not
        finished, connected, not paused for flow control)."""
        cycle = self.cycle
        return (
            self.chunked
            and cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
        )

    def write_chunk(self, body: bytes) -> None:
        """One part of the body (when chunk_ready()); an empty one writes nothing (it would
        end the body: h11 writes nothing for it either)."""
        if body:
            self.cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def abort_connection(self) -> None:
        """Drop the connection and what waits in its buffer (its client stopped reading)."""
        self.cycle.transport.abort()


def protocol_class(header_timeout: float, write_timeout: float = 30.0) -> type[BoundedH11Protocol]:
    fields = {"header_timeout": header_timeout, "write_timeout": write_timeout}
    return type("BoundedH11Protocol", (BoundedH11Protocol,), fields)


class BodyGone(Exception):
    """The client disconnected before its body arrived: nobody is left to answer."""


async def read_body(http: Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body; APIError 413 past max_bytes (checked against Content-Length first),
    408 when it takes longer than `timeout`; BodyGone if the client left."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s") from None
    except ClientDisconnect:
        raise BodyGone() from None


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {max_bytes} bytes", code="request_too_large"
    )


class RequestContext:
    """X-Request-Id in and out (scope["state"]["request_id"]), and the API key on /v1."""

    def __init__(self, app: ASGIApp, api_key: str | None = None, max_header_bytes: int = 65536):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        head_bytes += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head_bytes > self.max_header_bytes:  # h11 bounds only a head that arrives in parts
            error = APIError(431, f"the request head is larger than {self.max_header_bytes} bytes")
            return await _send_error(send, error, None)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        if given and not _REQUEST_ID.fullmatch(given):
            error = APIError(
                400,
                "X-Request-Id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
                param="X-Request-Id",
            )
            return await _send_error(send, error, None)
        request_id = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        authorized = self.api_key is None or not scope["path"].startswith("/v1")
        if not authorized:
            given_key = headers.get(b"authorization", b"")
            authorized = hmac.compare_digest(given_key, b"Bearer " + self.api_key)
        if not authorized:
            error = APIError(
                401,
                "a valid API key is required (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )
            return await _send_error(send, error, request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(http: Request) -> str:
    """The request's id: its X-Request-Id header, or one made up by RequestContext."""
    return http.scope.get("state", {}).get("request_id") or "-"


async def _send_error(send: Send, error: APIError, request_id: str | None) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
