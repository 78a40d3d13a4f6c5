"""From a request's engine outputs to OpenAI responses: Server-Sent Events in OpenAI's chunk
format (one event per sampled token that produced text, then `data: [DONE]`) or one JSON body.

Chat streams open with a role chunk, as OpenAI's do; the last text delta carries the finish
reason; with stream_options.include_usage every chunk has `"usage": null` and a final chunk
with empty choices carries the usage. An engine error mid-stream becomes an error event
(`data: {"error": {...}}`) before `[DONE]`, since the 200 status has already been sent.

Several prompts (completions) and n samples each are one response: choice index = prompt
index x n + sample index; usage counts every prompt once and every completion's tokens.
Logprobs, when asked for: chat `logprobs.content[] = {token, logprob, bytes, top_logprobs}`,
completions `{tokens, token_logprobs, top_logprobs, text_offset}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...engine import FinishReason
from ..core.engine_client import EngineUnavailable
from ..core.request_stream import Backlog, RequestStream, StreamOutput
from .connection import CHUNK_WRITER, ChunkWriter
from .errors import APIError
from .protocol import (
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
    `usage` (the last chunk with stream_options.include_usage), `whole` (non-streaming).
    token_text(id) -> the token's text, for logprobs."""

    chunk_type: type
    whole_type: type

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        token_text: Callable[[int], str] = str,
        num_choices: int = 1,
    ):
        self.include_usage = include_usage
        self.token_text = token_text
        self.num_choices = num_choices
        self.offsets = [0] * num_choices  # completions' text_offset per choice
        # one id and timestamp for every chunk of the response
        self.meta = {"id": request_id, "created": int(time.time()), "model": model}

    @property
    def meta(self) -> dict:
        return self._meta

    @meta.setter
    def meta(self, meta: dict) -> None:
        """Also the JSON around every chunk's choice, encoded once per response."""
        self._meta = meta
        head = _dumps({**meta, "object": self.chunk_object})
        self._head = head[:-1] + ',"choices":['
        self._tail = '],"usage":null}' if self.include_usage else "]}"

    def opening(self) -> str | None:
        return None

    def delta(self, index: int, out: StreamOutput, finish_reason: str | None) -> str:
        """One chunk's JSON: the per-token hot path of a stream, so the text around the choice
        is encoded once per response and the choice is formatted from its few values (a
        pydantic model per token cost ~5x more, json.dumps of the chunk ~3x); the same bytes as
        `chunk_type(...).model_dump_json` (tests/test_http_processes.py checks)."""
        logprobs = self.logprobs(index, out)
        choice = self._choice(
            index,
            _string(out.text),
            "null" if finish_reason is None else _string(finish_reason),
            "null" if logprobs is None else _dumps(logprobs),
            bool(out.text),
        )
        return f"{self._head}{choice}{self._tail}"

    def usage(self, usage: Usage) -> str:
        return self.chunk_type(**self.meta, choices=[], usage=usage).model_dump_json()

    def whole(self, choices: list[tuple[str, str | None, dict | None]], usage: Usage) -> dict:
        built = [self._whole_choice(i, *c) for i, c in enumerate(choices)]
        return self.whole_type(**self.meta, choices=built, usage=usage).model_dump()

    def _entry(self, token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        text = self.token_text(token_id)
        return text, _finite(logprob), list(text.encode("utf-8", "replace"))


_string = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) writes for a str


def _dumps(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _finite(value: float) -> float:
    """JSON has no -inf: a token of probability 0 gets the most negative float (as vLLM's
    -9999.0 stand-in, but exact in ordering)."""
    return value if value > -float("inf") else -9999.0


class ChatFormat(_Format):
    chunk_type, whole_type = ChatCompletionChunk, ChatCompletion
    chunk_object = "chat.completion.chunk"

    def opening(self) -> str | None:
        choices = [
            ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
            for i in range(self.num_choices)
        ]
        chunk = ChatCompletionChunk(**self.meta, choices=choices)
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def logprobs(self, index: int, out: StreamOutput) -> dict | None:
        if out.logprobs is None:
            return None
        content = []
        for lp in out.logprobs:
            token, logprob, raw = self._entry(lp.token_id, lp.logprob)
            top = []
            for t, v in lp.top:
                t_text, t_lp, t_raw = self._entry(t, v)
                top.append({"token": t_text, "logprob": t_lp, "bytes": t_raw})
            content.append({"token": token, "logprob": logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str, logprobs: str, has_text: bool) -> str:
        """ChatChunkChoice's JSON from its values' JSON (no content key without text)."""
        delta = f'{{"content":{text}}}' if has_text else "{}"
        return (
            f'{{"index":{index},"delta":{delta},"finish_reason":{finish_reason},'
            f'"logprobs":{logprobs}}}'
        )

    def _whole_choice(self, index, text, finish_reason, logprobs):
        return ChatChoice(
            index=index, message=AssistantMessage(content=text), finish_reason=finish_reason,
            logprobs=logprobs,
        )  # fmt: skip

    @staticmethod
    def merge_logprobs(parts: list[dict]) -> dict | None:
        return {"content": [c for p in parts for c in p["content"]]} if parts else None


class CompletionFormat(_Format):
    chunk_type = whole_type = Completion
    chunk_object = "text_completion"

    def logprobs(self, index: int, out: StreamOutput) -> dict | None:
        if out.logprobs is None:
            return None
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in out.logprobs:
            token, logprob, _ = self._entry(lp.token_id, lp.logprob)
            body["tokens"].append(token)
            body["token_logprobs"].append(logprob)
            body["top_logprobs"].append({self._entry(t, v)[0]: _finite(v) for t, v in lp.top})
            body["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(token)
        return body

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str, logprobs: str, has_text: bool) -> str:
        """CompletionChoice's JSON from its values' JSON."""
        return (
            f'{{"index":{index},"text":{text},"finish_reason":{finish_reason},'
            f'"logprobs":{logprobs}}}'
        )

    def _whole_choice(self, index, text, finish_reason, logprobs):
        return CompletionChoice(
            index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
        )

    @staticmethod
    def merge_logprobs(parts: list[dict]) -> dict | None:
        if not parts:
            return None
        return {key: [v for p in parts for v in p[key]] for key in parts[0]}

    def with_prompt_logprobs(
        self, prompt: tuple | None, echoed: str, generated: dict | None
    ) -> dict | None:
        """echo + logprobs: the prompt's tokens first (the first token has no logprob: None, as
        OpenAI), then the generated ones, their text_offset shifted past the echoed prompt."""
        if prompt is None:
            return generated
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token_id, lp in zip(*prompt, strict=True):
            token = self.token_text(token_id)
            body["tokens"].append(token)
            body["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
            top = None if lp is None else {self._entry(t, v)[0]: _finite(v) for t, v in lp.top}
            body["top_logprobs"].append(top)
            body["text_offset"].append(offset)
            offset += len(token)
        for key, values in (generated or {}).items():
            shift = len(echoed) if key == "text_offset" else None
            body[key] += [v + shift for v in values] if shift is not None else values
        return body


Format = ChatFormat | CompletionFormat


log = logging.getLogger("pagedkern.serving")


def engine_error(request_id: str, out: StreamOutput) -> APIError:
    """A request that failed inside the engine: the cause goes to the log, the client gets the
    request id to quote (never the internal exception text). A schema the grammar engine could
    not follow (a limit met while generating) is the client's 400 naming response_format."""
    schema = (out.error or "").removeprefix("StructuredOutputError: ")
    if schema != out.error:  # (a short message: llguidance's verbose errors are off)
        log.warning("request %s: %s", request_id, schema)
        return APIError(400, schema, param="response_format")
    log.error("request %s failed in the engine: %s", request_id, out.error)
    cause = tensor_parallel_cause(out.error)
    cause = f": {cause}" if cause else ""
    message = f"generation failed (request id {request_id}){cause}; the server log has the details"
    return APIError(500, message, type="server_error", code="engine_error")


_WORKER_EXITED = re.compile(r"tensor-parallel worker rank (\d+) \(pid \d+\) exited with (\w+ \d+)")
_RANK = re.compile(r"\brank (\d+)")


def tensor_parallel_cause(error: str | None) -> str | None:
    """The rank a broken tensor-parallel group names (its failure is the whole server's, not
    the request's, so the client may know it): "tensor-parallel worker rank 2 exited with
    signal 9", or "tensor-parallel rank 0 failed"; None for any other error."""
    if not error or not error.startswith("TensorParallelError"):
        return None
    if exited := _WORKER_EXITED.search(error):
        return f"tensor-parallel worker rank {exited[1]} exited with {exited[2]}"
    rank = _RANK.search(error)
    return f"tensor-parallel rank {rank[1]} failed" if rank else "the tensor-parallel group failed"


def unavailable(exc: EngineUnavailable) -> APIError:
    return APIError(503, str(exc), type="server_error", code="engine_unavailable")


def event(data: str) -> str:
    return f"data: {data}\n\n"


# A format's delta may be several chunks (chat_output.py: a tool call's two), joined by this,
# or "" for none: event() of the joined text is then their events.
CHUNK_SEPARATOR = "\n\ndata: "


async def merged(
    streams: list[RequestStream],
) -> AsyncIterator[list[tuple[int, StreamOutput]]]:
    """Batches of (choice index, output) from every stream as they come (a batch: what one
    stream delivered at once, see RequestStream.batches); choice = prompt x n + sample."""
    if len(streams) == 1:  # (sse_events reads one stream without this layer)
        async for batch in streams[0].batches():
            yield [(out.index, out) for out in batch]
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for batch in stream.batches():
                await q.put((k, [(k * stream.samples + out.index, out) for out in batch]))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await q.put((k, exc))
        finally:
            await q.put((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            _, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


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
        yield event(json.dumps(unavailable(exc).body()))
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


async def collect(
    streams: list[RequestStream], fmt: Format, http: HTTPRequest, echo: list[str] | None = None
) -> dict | None:
    """The whole answer as a response body; None if the client disconnected first (the
    requests are then aborted). Raises APIError for an engine error. echo: per prompt, text
    put before each of its choices."""
    texts: list[list[str]] = [[] for _ in range(fmt.num_choices)]
    logprobs: list[list[dict]] = [[] for _ in range(fmt.num_choices)]
    finals: dict[int, StreamOutput] = {}
    tokens = 0

    async def gather() -> None:
        nonlocal tokens
        async for batch in merged(streams):
            for index, out in batch:
                texts[index].append(out.text)
                tokens += len(out.token_ids)
                lp = fmt.logprobs(index, out)
                if lp is not None:
                    logprobs[index].append(lp)
                if out.finished:
                    finals[index] = out

    gathering = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({gathering, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not gathering.done():
            gathering.cancel()
        for stream in streams:
            stream.close()
    if not gathering.done() or gathering.cancelled():
        return None
    try:
        gathering.result()
    except EngineUnavailable as exc:
        raise unavailable(exc) from exc
    for final in finals.values():
        if final.finish_reason is FinishReason.ERROR:
            raise engine_error(streams[0].request_id, final)
    usage = Usage.of(sum(s.prompt_tokens for s in streams), tokens)
    per_prompt = fmt.num_choices // len(streams)
    choices = []
    for i in range(fmt.num_choices):
        echoed = echo[i // per_prompt] if echo else ""
        lp = fmt.merge_logprobs(logprobs[i])
        if echo:  # the prompt's logprobs, from the core's first delta of that prompt
            lp = fmt.with_prompt_logprobs(streams[i // per_prompt].prompt_logprobs, echoed, lp)
        choices.append(
            (echoed + "".join(texts[i]), openai_finish_reason(finals[i].finish_reason), lp)
        )
    return fmt.whole(choices, usage)


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client goes away (the body has been read, so the next ASGI message is
    http.disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
