"""A non-streaming response: every choice's whole answer gathered from the request streams
into one JSON body (body_formats.py shapes it), unless the client leaves first."""

from __future__ import annotations

import asyncio

from starlette.requests import Request as HTTPRequest

from ...engine import FinishReason
from ..core.client_errors import EngineUnavailable
from ..core.request_stream import RequestStream, StreamOutput
from .body_formats import Format
from .error_mapping import engine_error, unavailable
from .merged_streams import merged
from .response_models import Usage, openai_finish_reason


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
        raise unavailable(str(exc)) from exc
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
