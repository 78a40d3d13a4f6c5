"""Several request streams read as one (a completions request's prompts, each with its n
samples): batches of (choice index, output) as each stream delivers them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..core.request_stream import RequestStream, StreamOutput


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
