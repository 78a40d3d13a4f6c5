"""`pagedkern-serve --http --tensor-parallel-size 3` answers the official openai client; 16
concurrent streams, half of them cancelled, leave no KV block held; SIGINT stops rank 0 and
its workers (no orphan process)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import http_stack  # noqa: F401 - skips this module without the HTTP stack
import httpx
import openai
import pytest
from tensor_parallel_cases import mqa_folder
from test_tensor_parallel_lifecycle import DEADLINE_S, wait_gone

# Slow: a four-process server per test; TP's worker failures through HTTP without it:
# test_http_faults, and the process group's lifecycle: test_tensor_parallel_lifecycle.
pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "pagedkern.serving.cli"]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(x) for x in (task / "children").read_text().split()]
    return found


def blocks_used(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=DEADLINE_S).text
    return int(float(re.search(r"^\S*kv_blocks_used\S* (\S+)$", text, re.M).group(1)))


async def _streams(url: str, model: str) -> list[int]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model=model,
            prompt=f"the capital {i}",
            max_tokens=12,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},  # the random model may draw its EOS early
        )
        chunks = 0
        async for _ in stream:
            chunks += 1
            if i % 2 and chunks == 2:  # a client that goes away mid-answer
                await stream.close()
                break
        return chunks

    try:
        return await asyncio.gather(*(one(i) for i in range(16)))
    finally:
        await client.close()


def start_server(tmp_path) -> tuple[subprocess.Popen, str, list[int]]:
    model = mqa_folder(tmp_path / "mqa")
    proc = subprocess.Popen(
        [*CLI, "--http", "--port", "0", "--model", model, "--backend", "reference"]
        + ["--tensor-parallel-size", "3", "--num-blocks", "96", "--block-size", "4"],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # the listening line comes once the model is loaded
        if match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
            break
    else:
        raise AssertionError(f"the server exited with {proc.wait()}")
    # the HTTP front end's children: the engine core (rank 0, the workers' parent) and
    # multiprocessing's resource tracker
    workers = [w for child in children(proc.pid) for w in children(child)]
    assert len(workers) == 2
    return proc, match.group(1), workers


def test_tp3_server_answers_openai_and_cleans_up(tmp_path):
    proc, url, workers = start_server(tmp_path)
    model = "mqa"  # served under the folder's name
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(  # sampled at temperature 1: EOS may come at any step
            model=model, prompt="the capital", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 4
        chunks = asyncio.run(_streams(url, model))
        assert all(c == 2 for c in chunks[1::2]) and all(c > 2 for c in chunks[::2])
        end = time.monotonic() + DEADLINE_S
        while blocks_used(url) and time.monotonic() < end:
            time.sleep(0.05)  # poll interval: aborts are processed by the engine thread
        assert blocks_used(url) == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(DEADLINE_S) == 0
        assert wait_gone(workers), f"orphan workers {workers}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tp3_server_fails_open_requests_and_exits_when_a_worker_dies(tmp_path):
    proc, url, workers = start_server(tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="mqa",
            prompt="the capital",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        os.kill(workers[1], signal.SIGKILL)
        # the stream's error names the rank (the README promises it)
        failed = "generation failed .*: tensor-parallel worker rank 2 exited with signal 9"
        with pytest.raises(openai.APIError, match=failed):
            list(chunks)
        assert proc.wait(DEADLINE_S) == 1
        err = proc.stderr.read()
        assert f"worker rank 2 (pid {workers[1]}) exited with signal 9" in err, err
        assert wait_gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
