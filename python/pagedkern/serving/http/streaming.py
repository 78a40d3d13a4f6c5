"""A streaming response's body: Server-Sent Events in OpenAI's chunk format (body_formats.py),
one event per sampled token that produced text, then `data: [DONE]`.

An engine error mid-stream becomes an error event (`data: {"error": {...}}`) before `[DONE]`,
since the 200 status has already been sent. The events travel in an EventStreamResponse
(event_stream_response.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from ...engine import FinishReason
from ..core.client_errors import EngineUnavailable
from ..core.request_stream import Backlog, RequestStream, StreamOutput
from .body_formats import Format
from .connection import ChunkWriter
from .error_mapping import engine_error, unavailable
from .merged_streams import merged
from .response_models import Usage, openai_finish_reason

log = logging.getLogger("pagedkern.serving")


def event(data: str) -> str:
    return f"data: {data}\n\n"


async def sse_events(
    streams: list[RequestStream],
    fmt: Format,
    writer: ChunkWriter | None = None,
    write_buffer_bytes: int | None = None,
) -> AsyncIterator[str]:
    """The response body in pieces: the events of one batch of outputs per piece (one write).

    The per-step hot path of a stream. One stream (n = 1, one prompt: the common request) is
    read with next_batch directly, without merged()'s generators in between; and given the
    connection's `writer` (connection.py's ChunkWriter), its
    unfinished outputs are written by the frame handler as they arrive (RequestStream.sink):
    no task wake-up, generator step or ASGI send chain per token. Only what that cannot write
    at once (flow control paused, client gone) and the end (finish, usage, [DONE], an error)
    come through here, in order.

    write_buffer_bytes bounds what the client has not taken (Backlog): past it, the requests
    are aborted and the connection dropped."""
    backlog = None
    if write_buffer_bytes is not None:
        backlog = Backlog(write_buffer_bytes, lambda: _client_not_reading(streams, writer))
        for stream in streams:
            backlog.watch(stream)
    opening = fmt.opening()
    if opening is not None:
        yield event(opening)
    events = _EventWriter(streams, fmt)
    try:
        if len(streams) == 1:
            stream = streams[0]
            if writer is not None:
                stream.sink = events.direct(writer)
            try:
                while batch := await stream.next_batch():
                    piece = events.of([(out.index, out) for out in batch])
                    if piece:
                        events.sending = True  # the sink waits until it is written
                        yield piece
                        events.sending = False
                    if backlog is not None:
                        backlog.sent(batch)
                    if events.ended:
                        break
            finally:
                stream.sink = None
        else:
            async for batch in merged(streams):
                piece = events.of(batch)
                if piece:
                    yield piece
                if backlog is not None:
                    backlog.sent(out for _, out in batch)
                if events.ended:
                    break
    except EngineUnavailable as exc:
        yield event(json.dumps(unavailable(str(exc)).body()))
    yield "data: [DONE]\n\n"


def _client_not_reading(streams: list[RequestStream], writer: ChunkWriter | None) -> None:
    """A response's client has left more than the write buffer untaken: abort its requests
    (their KV is freed before the next step), drop what they hold and the connection."""
    log.warning(
        "request %s: the client has not taken %d bytes of events: aborting it",
        streams[0].request_id,
        streams[0].backlog.limit,
    )
    for stream in streams:
        stream.close()
    if writer is not None:
        writer.abort_connection()


class _EventWriter:
    """The SSE events of batches of (choice index, output); `ended` after an error event."""

    def __init__(self, streams: list[RequestStream], fmt: Format):
        self.streams, self.fmt = streams, fmt
        self.completion_tokens, self.open_choices = 0, fmt.num_choices
        self.prompt_tokens = sum(s.prompt_tokens for s in streams)
        self.ended = False
        self.sending = False  # a piece is on its way through the response's send

    def direct(self, writer: ChunkWriter) -> Callable[[object], bool]:
        """A RequestStream sink writing an unfinished output's event itself when the
        connection can take it now."""

        def deliver(item) -> bool:
            if (
                self.sending  # (a piece waiting for flow control to resume goes first)
                or not isinstance(item, StreamOutput)
                or item.finished
                or not writer.chunk_ready()
            ):
                return False
            piece = self.of([(item.index, item)])
            if piece:  # (a parsed answer's delta may hold everything back)
                writer.write_chunk(piece.encode())
            return True

        return deliver

    def of(self, batch: list[tuple[int, StreamOutput]]) -> str:
        fmt, events = self.fmt, []
        for index, out in batch:
            self.completion_tokens += len(out.token_ids)
            if not out.finished:
                if (out.text or out.logprobs) and (chunk := fmt.delta(index, out, None)):
                    events.append(event(chunk))
                continue
            if out.finish_reason is FinishReason.ERROR:
                events.append(
                    event(json.dumps(engine_error(self.streams[0].request_id, out).body()))
                )
                self.ended = True  # the stream ends here
                break
            events.append(event(fmt.delta(index, out, openai_finish_reason(out.finish_reason))))
            self.open_choices -= 1
            if fmt.include_usage and self.open_choices == 0:
                usage = Usage.of(self.prompt_tokens, self.completion_tokens)
                events.append(event(fmt.usage(usage)))
        return "".join(events)
