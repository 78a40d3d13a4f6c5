"""A lean load client for measuring an HTTP front end's delivered throughput: N concurrent
streamed /v1/completions requests on raw asyncio sockets (no HTTP library: the client must cost
as little CPU as possible, since it shares the machine with the server it measures).

    python bench/stream_client.py http://127.0.0.1:8000 --model synthetic:tiny \\
        --streams 256 --max-tokens 64

Prints one JSON line: {"streams", "completed", "output_tokens", "seconds", "tok_per_s",
"cpu_seconds", "errors"} (cpu_seconds: this client's own CPU time over the run). Every
request asks for ignore_eos and stream_options.include_usage; its output
tokens are the usage chunk's completion_tokens, checked against the number of text events.
Time runs from the first request sent to the last [DONE] received.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from urllib.parse import urlsplit


def request_bytes(host: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


def dechunk(body: bytes) -> bytes:
    """The payload of a `Transfer-Encoding: chunked` body."""
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        pos = end + 4 + size


def parse_stream(raw: bytes) -> tuple[int, int]:
    """(usage completion_tokens, text events) of one SSE response; ValueError if incomplete."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status:
        raise ValueError(f"{status.decode(errors='replace')}: {body[:200]!r}")
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        raise ValueError("the stream did not end with [DONE]")
    usage, texts = None, 0
    for data in events[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error event: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        texts += sum(1 for c in chunk.get("choices", ()) if c.get("text"))
    if usage is None:
        raise ValueError("no usage chunk")
    return usage, texts


class _Response(asyncio.Protocol):
    """Collects one response's bytes (Connection: close: it ends at EOF). A bare protocol, not
    a StreamReader: no coroutine wake-up per received segment."""

    def __init__(self, request: bytes):
        self.request, self.parts = request, []
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(b"".join(self.parts))


async def one(host: str, port: int, body: dict) -> bytes:
    loop = asyncio.get_running_loop()
    request = request_bytes(f"{host}:{port}", body)
    transport, response = await loop.create_connection(lambda: _Response(request), host, port)
    try:
        return await response.done
    finally:
        transport.close()


async def run(url: str, model: str, streams: int, max_tokens: int) -> dict:
    parts = urlsplit(url)
    bodies = [
        {
            "model": model,
            "prompt": f"stream {i} tells a story about the river and the city",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        for i in range(streams)
    ]
    start, cpu = time.perf_counter(), time.process_time()
    raws = await asyncio.gather(
        *(one(parts.hostname, parts.port, b) for b in bodies), return_exceptions=True
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens, completed, errors = 0, 0, []
    for raw in raws:
        try:
            if isinstance(raw, BaseException):
                raise ValueError(repr(raw))
            usage, texts = parse_stream(raw)
            if texts > usage:
                raise ValueError(f"{texts} text events for {usage} tokens")
        except ValueError as exc:
            errors.append(str(exc))
            continue
        tokens += usage
        completed += 1
    return {
        "streams": streams,
        "completed": completed,
        "output_tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "cpu_seconds": cpu,
        "errors": errors[:5],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.url, args.model, args.streams, args.max_tokens))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["errors"] == [] else 1)
