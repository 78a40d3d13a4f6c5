"""The ASGI response that carries a stream's Server-Sent Events (streaming.py makes them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .connection import CHUNK_WRITER, ChunkWriter


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` when it ends: stream finished, client
    disconnected (the body iterator is cancelled), send failed, or never started.

    The body streams in one task while another waits for http.disconnect, as Starlette does
    for servers of ASGI spec < 2.4 (uvicorn's h11 says 2.3), but with two plain asyncio tasks:
    Starlette's anyio task group formatted the repr of the current task (its coroutine stack)
    into a message each time it cancelled the watcher, once per response, a measurable part
    of admitting a short request.

    The body's pieces go to the connection's ChunkWriter when it can take them at once (no ASGI
    send chain, no h11 per piece); the head, the end and anything that must wait for flow
    control go through `send`, in order."""

    def __init__(
        self,
        body: Callable[[ChunkWriter | None], AsyncIterator[str]],
        on_close: Callable[[], None],
    ):
        """body(writer): the body's pieces, given the connection's ChunkWriter if it has
        one (see sse_events)."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(_nothing(), media_type="text/event-stream", headers=headers)
        self.body, self.on_close = body, on_close
        self.writer: ChunkWriter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.writer = scope.get("extensions", {}).get(CHUNK_WRITER)
        self.body_iterator = self.body(self.writer)
        streaming = watching = None
        try:
            streaming = asyncio.ensure_future(self.stream_response(send))
            watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = [t for t in (streaming, watching) if t is not None]
            for task in tasks:
                task.cancel()
            try:
                done = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                self.on_close()
        failure = done[0]
        if isinstance(failure, BaseException) and not isinstance(failure, asyncio.CancelledError):
            raise failure

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        writer = self.writer
        async for chunk in self.body_iterator:
            body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            if writer is not None and writer.chunk_ready():
                writer.write_chunk(body)
            else:
                await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _nothing() -> AsyncIterator[str]:
    return
    yield  # (an async generator)
