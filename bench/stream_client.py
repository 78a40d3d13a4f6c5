"""A lean load client for measuring an HTTP front end's delivered throughput: N concurrent
streamed /v1/completions requests on raw sockets and one epoll loop (no HTTP library, no asyncio:
the client must cost as little CPU as possible, since it shares the machine with the server it
measures).

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
import json
import select
import socket
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


# Between two rounds of reads: one epoll wait then finds many sockets ready (an engine step
# makes a token on every stream) instead of one; the server's writes do not wait for the reads
# (the socket buffers hold them). Adds at most this much to the measured time.
READ_INTERVAL_S = 0.001
# Below glibc's mmap threshold (128 KiB): recv(n) allocates n bytes before shrinking them to
# what arrived, and a bigger n maps and unmaps fresh pages on every call.
RECV_BYTES = 1 << 16


def fetch_all(host: str, port: int, requests: list[bytes], timeout: float) -> list[bytes]:
    """Every request on its own connection (Connection: close: a response ends at EOF), all
    at once, on one epoll loop read in rounds (READ_INTERVAL_S): a readable socket costs one
    recv and one list append (asyncio's transports and protocols cost ~2x that per received
    segment, and a segment arrives per engine step per stream). Raises TimeoutError past
    `timeout` seconds without progress."""
    poller = select.epoll()
    socks, parts = {}, {}
    try:
        for request in requests:
            sock = socket.create_connection((host, port))
            sock.sendall(request)
            sock.setblocking(False)
            socks[sock.fileno()] = sock
            parts[sock.fileno()] = []
            poller.register(sock.fileno(), select.EPOLLIN)
        order = list(socks)
        open_fds = set(socks)
        while open_fds:
            events = poller.poll(timeout)
            if not events:
                raise TimeoutError(f"{len(open_fds)} responses unfinished after {timeout:g} s")
            for fd, _ in events:
                data = socks[fd].recv(RECV_BYTES)
                if data:
                    parts[fd].append(data)
                else:
                    poller.unregister(fd)
                    open_fds.discard(fd)
            time.sleep(READ_INTERVAL_S)
        return [b"".join(parts[fd]) for fd in order]
    finally:
        poller.close()
        for sock in socks.values():
            sock.close()


def run(url: str, model: str, streams: int, max_tokens: int, timeout: float = 600.0) -> dict:
    parts = urlsplit(url)
    host = f"{parts.hostname}:{parts.port}"
    requests = [
        request_bytes(
            host,
            {
                "model": model,
                "prompt": f"stream {i} tells a story about the river and the city",
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            },
        )
        for i in range(streams)
    ]
    start, cpu = time.perf_counter(), time.process_time()
    raws = fetch_all(parts.hostname, parts.port, requests, timeout)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens, completed, errors = 0, 0, []
    for raw in raws:
        try:
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
    result = run(args.url, args.model, args.streams, args.max_tokens)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["errors"] == [] else 1)
