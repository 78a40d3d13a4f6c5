"""The HTTP server under clients that stop reading and processes that stop or fail: a stream
whose client reads nothing is aborted (its KV freed) once its write buffer is full or its
socket has taken nothing for the write timeout; a core that completes no step while work waits
turns /health to 503 and fails the open requests after the stalled-request timeout; SIGTERM
with open streams ends every stream and both processes cleanly (status 0, no abort in the
core's exit); a broken tensor-parallel group's error names the rank."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading

import http_stack  # noqa: F401 - skips this module without the HTTP stack
import httpx
import pytest
from test_http_server import TINY, WAIT, sse_data

from pagedkern.serving.request_stream import StreamOutput
from pagedkern.serving.streaming import engine_error

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


@pytest.mark.parametrize("streams", [16, 32])
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
