"""From a request's engine outputs to OpenAI responses: Server-Sent Events in OpenAI's chunk
format (one event per sampled token that produced text, then `data: [DONE]`) or one JSON body.

Chat streams open with a role chunk, as OpenAI's do; the last text delta carries the finish
reason; with stream_options.include_usage every chunk has `"usage": null` and a final chunk
with empty choices carries the usage. An engine error mid-stream becomes an error event
(`data: {"error": {...}}`) before `[DONE]`, since the 200 status has already been sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine import FinishReason, RequestOutput
from .engine_loop import EngineUnavailable, RequestStream
from .errors import APIError
from .openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    Usage,
    openai_finish_reason,
)


class _Format:
    """Response bodies for one request: `opening` (streams only), `delta` per streamed text,
    `usage` (the last chunk with stream_options.include_usage), `whole` (non-streaming)."""

    chunk_type: type
    whole_type: type

    def __init__(self, request_id: str, model: str, include_usage: bool):
        self.include_usage = include_usage
        # one id and timestamp for every chunk of the response
        self.meta = {"id": request_id, "created": int(time.time()), "model": model}

    def opening(self) -> str | None:
        return None

    def delta(self, text: str, finish_reason: str | None) -> str:
        chunk = self.chunk_type(**self.meta, choices=[self._delta_choice(text, finish_reason)])
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def usage(self, usage: Usage) -> str:
        return self.chunk_type(**self.meta, choices=[], usage=usage).model_dump_json()

    def whole(self, text: str, finish_reason: str | None, usage: Usage) -> dict:
        choice = self._whole_choice(text, finish_reason)
        return self.whole_type(**self.meta, choices=[choice], usage=usage).model_dump()


class ChatFormat(_Format):
    chunk_type, whole_type = ChatCompletionChunk, ChatCompletion

    def opening(self) -> str | None:
        choice = ChatChunkChoice(delta=Delta(role="assistant", content=""))
        chunk = ChatCompletionChunk(**self.meta, choices=[choice])
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def _delta_choice(self, text: str, finish_reason: str | None):
        return ChatChunkChoice(delta=Delta(content=text or None), finish_reason=finish_reason)

    def _whole_choice(self, text: str, finish_reason: str | None):
        return ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)


class CompletionFormat(_Format):
    chunk_type = whole_type = Completion

    def _delta_choice(self, text: str, finish_reason: str | None):
        return CompletionChoice(text=text, finish_reason=finish_reason)

    _whole_choice = _delta_choice


Format = ChatFormat | CompletionFormat


log = logging.getLogger("pagedkern.serving")


def engine_error(request_id: str, out: RequestOutput) -> APIError:
    """A request that failed inside the engine: the cause goes to the log, the client gets the
    request id to quote (never the internal exception text)."""
    log.error("request %s failed in the engine: %s", request_id, out.error)
    message = f"generation failed (request id {request_id}); the server log has the details"
    return APIError(500, message, type="server_error", code="engine_error")


def unavailable(exc: EngineUnavailable) -> APIError:
    return APIError(503, str(exc), type="server_error", code="engine_unavailable")


def event(data: str) -> str:
    return f"data: {data}\n\n"


async def sse_events(stream: RequestStream, fmt: Format) -> AsyncIterator[str]:
    opening = fmt.opening()
    if opening is not None:
        yield event(opening)
    completion_tokens = 0
    try:
        async for out in stream.outputs():
            completion_tokens += len(out.token_ids)
            if out.finished and out.finish_reason is FinishReason.ERROR:
                yield event(json.dumps(engine_error(stream.request_id, out).body()))
                break
            if out.finished:
                yield event(fmt.delta(out.text, openai_finish_reason(out.finish_reason)))
                if fmt.include_usage:
                    yield event(fmt.usage(Usage.of(stream.prompt_tokens, completion_tokens)))
            elif out.text:
                yield event(fmt.delta(out.text, None))
    except EngineUnavailable as exc:
        yield event(json.dumps(unavailable(exc).body()))
    yield "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` when it ends: stream finished, client
    disconnected (Starlette cancels the body iterator), send failed, or never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def collect(stream: RequestStream, fmt: Format, http: HTTPRequest) -> dict | None:
    """The whole answer as a response body; None if the client disconnected first (the
    request is then aborted). Raises APIError for an engine error."""
    texts: list[str] = []
    tokens = 0
    final = None

    async def gather() -> None:
        nonlocal tokens, final
        async for out in stream.outputs():
            texts.append(out.text)
            tokens += len(out.token_ids)
            final = out

    gathering = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({gathering, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not gathering.done():
            gathering.cancel()
        stream.close()
    if not gathering.done() or gathering.cancelled():
        return None
    try:
        gathering.result()
    except EngineUnavailable as exc:
        raise unavailable(exc) from exc
    if final.finish_reason is FinishReason.ERROR:
        raise engine_error(stream.request_id, final)
    usage = Usage.of(stream.prompt_tokens, tokens)
    return fmt.whole("".join(texts), openai_finish_reason(final.finish_reason), usage)


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client goes away (the body has been read, so the next ASGI message is
    http.disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
