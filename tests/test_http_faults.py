"""The HTTP server under clients that stop reading and processes that stop or fail: a stream
whose client reads nothing is aborted (its KV freed) once its write buffer is full or its
socket has taken nothing for the write timeout; a core that completes no step while work waits
turns /health to 503 and fails the open requests after the stalled-request timeout; SIGTERM
with open streams ends every stream and both processes cleanly (status 0, no abort in the
core's exit); a broken tensor-parallel group's error names the rank."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import http_stack  # noqa: F401 - skips this module without the HTTP stack
import httpx
import pytest
from support.serving import ServerThread
from test_http_processes import children, cmdline
from test_http_server import LONG, TINY, WAIT, sse_data, tiny_engine

from pagedkern.engine import SamplingParams
from pagedkern.serving.core.request_stream import Backlog, RequestStream, StreamOutput, event_bytes
from pagedkern.serving.http.error_mapping import engine_error
from pagedkern.serving.http.settings import ServerSettings

CLI = [sys.executable, "-m", "pagedkern.serving.cli", "--http", "--port", "0"]


class Server:
    """`pagedkern-serve --http` in a process of its own, its stderr kept."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [*CLI, "--model", TINY, "--backend", "reference", *args],
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        for line in self.proc.stderr:  # the listening line comes once the core has loaded
            self.lines.append(line)
            if match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
                break
        else:
            raise AssertionError(f"the server exited with {self.proc.wait()}: {self.lines}")
        self.url = match.group(1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def stderr(self) -> str:
        self._reader.join(WAIT)
        return "".join(self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- SIGTERM with open streams -----------------------------------------------------------------


# 32 streams in the fast set; 16 (the same path, fewer streams open at the signal) is slow
@pytest.mark.parametrize("streams", [pytest.param(16, marks=pytest.mark.slow), 32])
def test_sigterm_with_open_streams_ends_every_stream_and_both_processes_cleanly(streams):
    """Every stream gets its abort finish and [DONE]; the front end exits 0 (as documented for
    Ctrl-C / SIGTERM; uvicorn re-raised SIGTERM, which killed it with -15) and the core exits
    without an error (its interpreter shutdown sometimes aborted: "terminate called without
    an active exception", which the front end now also reports as the core's exit status)."""
    server = Server()
    try:
        running = threading.Barrier(streams + 1, timeout=WAIT)
        ends: dict[int, list[str]] = {}

        def one(i: int) -> None:
            body = {
                "model": TINY, "prompt": f"go on {i}", "max_tokens": 4000, "stream": True,
                "ignore_eos": True,
            }  # fmt: skip
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT) as r:
                data = sse_data(r)
                next(data)  # this stream runs
                running.wait()
                ends[i] = list(data)[-2:]

        clients = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for client in clients:
            client.start()
        running.wait()  # every stream has had its first event
        server.proc.send_signal(signal.SIGTERM)
        status = server.proc.wait(WAIT)
        for client in clients:
            client.join(WAIT)
        err = server.stderr()
        assert status == 0, err
        assert "terminate called" not in err and "engine core exited" not in err, err
        assert len(ends) == streams
        for last, done in ends.values():
            assert done == "[DONE]"
            assert json.loads(last)["choices"][0]["finish_reason"] == "abort"
    finally:
        server.close()


# --- a broken tensor-parallel group ----------------------------------------------------------


def test_a_tensor_parallel_failure_names_the_rank_and_nothing_else_does():
    """The TP server test (test_tensor_parallel_http.py) checks this over a real TP = 3 server;
    here: the rank comes through, pid and internal exception text do not, other errors stay
    opaque."""
    exited = "TensorParallelError: tensor-parallel worker rank 2 (pid 4242) exited with signal 9"
    message = engine_error("r1", StreamOutput("", [], True, None, error=exited)).message
    assert message.startswith("generation failed (request id r1): ")
    assert "tensor-parallel worker rank 2 exited with signal 9" in message
    assert "4242" not in message
    broken = "TensorParallelError: tensor-parallel step failed on rank 0: RuntimeError('secret')"
    message = engine_error("r2", StreamOutput("", [], True, None, error=broken)).message
    assert "tensor-parallel rank 0 failed" in message and "secret" not in message
    other = "RuntimeError: secret rank 3"
    message = engine_error("r3", StreamOutput("", [], True, None, error=other)).message
    assert "secret" not in message and "rank" not in message


# --- a client that stops reading -------------------------------------------------------------


def non_reader(url: str, body: dict) -> socket.socket:
    """A client that sends a request and never reads a byte of the answer (a small receive
    buffer, so the server's side fills up soon)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    sock.sendall(head.encode() + b"content-length: %d\r\n\r\n%b" % (len(data), data))
    return sock


def flood(**extra) -> dict:
    """A stream of many big events: 4 samples, 20 logprobs a token (~1.5 KB an event)."""
    return {
        "model": TINY, "prompt": "go on", "max_tokens": LONG, "stream": True, "ignore_eos": True,
        "n": 4, "logprobs": 20, **extra,
    }  # fmt: skip


def blocks_used(server: ServerThread) -> int:
    return server.engine_loop.run_in_engine(lambda e: e.stats().num_blocks_used).result(WAIT)


def assert_cut_off(sock: socket.socket) -> None:
    """The server dropped the connection before the stream's end (reading what is left)."""
    sock.settimeout(WAIT)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    assert b"data: [DONE]" not in received[-64:]


@pytest.mark.parametrize("limit", ["write_buffer", "write_timeout"])
def test_a_client_that_stops_reading_is_aborted_and_its_kv_freed(limit):
    """The stream's client reads nothing: once its untaken events pass the write buffer (or its
    socket has taken nothing for the write timeout), its samples are aborted, their KV blocks
    freed and the connection dropped, while other clients are served. Before, the samples ran
    to max_tokens (finish "length") with every event kept in the front end's memory, and the
    connection stayed open."""
    if limit == "write_buffer":
        settings = ServerSettings(write_buffer_bytes=256 * 1024, write_timeout=600)
    else:  # the buffer bound out of reach: the write timeout acts
        settings = ServerSettings(write_buffer_bytes=2**30, write_timeout=0.5)
    with ServerThread(tiny_engine(max_num_seqs=8), settings=settings) as server:
        client = server.engine_loop
        sock = non_reader(server.url, flood())
        try:
            assert client.wait_for(lambda: client.metrics.finished, WAIT)
            assert client.wait_for(lambda: client.num_live == 0, WAIT)
            assert client.metrics.finished == {"abort": 4}
            assert blocks_used(server) == 0
            r = httpx.post(
                server.url + "/v1/completions",
                json={  # sampled at temperature 1: without ignore_eos, EOS may come first
                    "model": TINY,
                    "prompt": "still there?",
                    "max_tokens": 2,
                    "ignore_eos": True,
                },
                timeout=WAIT,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert_cut_off(sock)
        finally:
            sock.close()


def test_a_closed_stream_drops_what_it_held_for_its_handler():
    """Closing (client gone, buffer full) frees the outputs a stream held: nothing is left to
    format on the event loop (before: 19 s of formatting 4 x 64-sample backlogs), and what
    arrives later is dropped."""
    backlog = Backlog(10**9, lambda: None)
    owner, tokenizer = SimpleNamespace(abort=lambda *_: None), SimpleNamespace(decode=str)
    stream = RequestStream("r", SamplingParams(), frozenset(), tokenizer, owner.abort, None)
    backlog.watch(stream)
    outs = [StreamOutput("x" * 100, [1], False, None) for _ in range(10)]
    for out in outs:
        stream.put(out)
    assert backlog.size == sum(map(event_bytes, outs)) > 0
    stream.close()
    assert stream._ready == [] and backlog.size == 0
    stream.put(outs[0])
    assert stream._ready == [] and backlog.size == 0


# --- a core that stops stepping --------------------------------------------------------------


def test_a_core_stuck_in_a_step_turns_health_503_and_fails_open_requests():
    """The core blocks after a step (as on a stopped TP worker): /health turns 503 once no step
    has completed for the step timeout while a stream waits, /metrics still answers, a new
    request is a 503, and the stream ends with an engine_unavailable error after the stalled-
    request timeout. Once the core steps again its KV is freed and /health is 200. Before,
    /health said 200 and the stream waited for as long as the core did."""
    armed, stuck, release = threading.Event(), threading.Event(), threading.Event()

    def after_step(_engine) -> None:
        if armed.is_set() and not stuck.is_set():
            stuck.set()
            release.wait(WAIT)

    settings = ServerSettings(step_timeout=0.2, stalled_request_timeout=0.4)
    with ServerThread(tiny_engine(), after_step=after_step, settings=settings) as server:
        client = server.engine_loop
        body = {"model": TINY, "prompt": "go on", "max_tokens": LONG, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT) as r:
                data = sse_data(r)
                next(data)  # the stream runs
                armed.set()
                assert stuck.wait(WAIT)
                assert client.wait_for(lambda: client.stalled is not None, WAIT)
                health = httpx.get(server.url + "/health", timeout=WAIT)
                assert health.status_code == 503, health.text
                assert "no step" in health.json()["error"]["message"]
                assert httpx.get(server.url + "/metrics", timeout=WAIT).status_code == 200
                late = httpx.post(server.url + "/v1/completions", json={**body, "stream": False})
                assert late.status_code == 503 and "no step" in late.text
                rest = list(data)
            assert rest[-1] == "[DONE]"
            error = json.loads(rest[-2])["error"]
            assert error["code"] == "engine_unavailable" and "no step" in error["message"]
        finally:
            release.set()
        assert client.wait_for(lambda: client.stalled is None, WAIT)
        assert blocks_used(server) == 0
        assert httpx.get(server.url + "/health", timeout=WAIT).status_code == 200


def test_a_stopped_engine_core_process_fails_open_streams_and_health():
    """SIGSTOP on the real core process: the open stream ends with an engine_unavailable error
    event and [DONE], /health is 503 and /metrics answers; after SIGCONT the server stops
    cleanly."""
    server = Server("--step-timeout", "0.3", "--stalled-request-timeout", "0.6")
    try:
        core = [pid for pid in children(server.proc.pid) if b"spawn_main" in cmdline(pid)]
        assert len(core) == 1
        body = {"model": TINY, "prompt": "go on", "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT) as r:
            data = sse_data(r)
            next(data)  # the stream runs
            os.kill(core[0], signal.SIGSTOP)
            try:
                rest = list(data)
                health = httpx.get(server.url + "/health", timeout=WAIT)
                metrics = httpx.get(server.url + "/metrics", timeout=WAIT)
            finally:
                os.kill(core[0], signal.SIGCONT)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_unavailable"
        assert health.status_code == 503 and "no step" in health.text
        assert metrics.status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT) == 0, server.stderr()
    finally:
        server.close()
