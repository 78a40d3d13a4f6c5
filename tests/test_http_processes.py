"""`pagedkern-serve --http` runs as two processes, the HTTP front end and the engine core it
spawns (serving/core/engine_client.py, core_process.py): killing either one is handled (503 and a
non-zero exit; no orphan), a core that cannot load says why, the frames between them are
msgpack, never pickle, and a CPU core runs its steps on the intra-op threads it chose (or was
given)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import http_stack  # noqa: F401 - skips this module without the HTTP stack
import httpx
import msgpack
import pytest
import torch
from support.serving import ServerThread, in_thread
from test_http_server import LONG, TINY, WAIT, sse_data, tiny_engine, user
from test_tensor_parallel_lifecycle import wait_gone

from pagedkern.engine import EngineConfig, FinishReason, SamplingParams
from pagedkern.engine.outputs import TokenLogprob
from pagedkern.processes import available_cores
from pagedkern.serving.cli import args as cli_args
from pagedkern.serving.core import channel, core_process
from pagedkern.serving.core.engine_client import EngineClient
from pagedkern.serving.core.messages import Add, Added, SampleDelta, Stats, StepOutputs, Stop
from pagedkern.serving.core.request_stream import StreamOutput
from pagedkern.serving.http.body_formats import ChatFormat, CompletionFormat
from pagedkern.serving.http.response_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
)
from pagedkern.serving.http.settings import ServerSettings

CLI = [sys.executable, "-m", "pagedkern.serving.cli", "--http", "--port", "0"]


def start_server(*args: str) -> tuple[subprocess.Popen, str, int]:
    """The server process, its URL and its engine core's pid."""
    proc = subprocess.Popen(
        [*CLI, "--model", TINY, "--backend", "reference", *args], stderr=subprocess.PIPE, text=True
    )
    for line in proc.stderr:  # the listening line comes once the core has loaded the model
        if match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
            break
    else:
        raise AssertionError(f"the server exited with {proc.wait()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # never block its writes
    cores = [pid for pid in children(proc.pid) if b"spawn_main" in cmdline(pid)]
    assert len(cores) == 1, children(proc.pid)
    return proc, match.group(1), cores[0]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(x) for x in (task / "children").read_text().split()]
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def long_body(stream: bool) -> dict:
    return {
        "model": TINY,
        "prompt": "go on",
        "max_tokens": LONG,
        "stream": stream,
        "ignore_eos": True,
    }


def wait_for_requests(url: str, count: int) -> None:
    """Until the engine core holds `count` requests (running or waiting), as /metrics says."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        metrics = httpx.get(url + "/metrics", timeout=WAIT).text
        held = sum(
            int(m.group(1))
            for name in ("running", "waiting")
            if (m := re.search(rf"^pagedkern_num_requests_{name} (\d+)$", metrics, re.M))
        )
        if held >= count:
            return
        time.sleep(0.01)  # (a poll: the test waits on the condition, not on the time)
    raise AssertionError(f"the core never held {count} requests")


def test_a_killed_engine_core_fails_open_requests_with_503_and_the_server_exits_1():
    proc, url, core = start_server()
    try:
        whole: dict = {}
        waiting = threading.Thread(
            target=lambda: whole.update(
                r=httpx.post(url + "/v1/completions", json=long_body(False), timeout=WAIT)
            )
        )
        with httpx.stream("POST", url + "/v1/completions", json=long_body(True), timeout=WAIT) as r:
            data = sse_data(r)
            next(data)  # the stream runs
            waiting.start()
            wait_for_requests(url, 2)  # the other request is open too (else: connection refused)
            os.kill(core, signal.SIGKILL)
            rest = list(data)
        waiting.join(WAIT)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_unavailable"
        assert whole["r"].status_code == 503
        assert whole["r"].json()["error"]["code"] == "engine_unavailable"
        assert proc.wait(WAIT) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_the_engine_core_ends_with_its_front_end(how):
    proc, url, core = start_server()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=long_body(True), timeout=WAIT) as r:
            next(sse_data(r))  # the core is busy with a request
            proc.send_signal(how)
            code = proc.wait(WAIT)
        assert code == (-signal.SIGKILL if how == signal.SIGKILL else 0)  # SIGINT: a clean stop
        assert wait_gone([core]), f"orphan engine core {core}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_core_that_cannot_load_says_why_and_exits_2(tmp_path):
    missing = tmp_path / "no-such-model"
    done = subprocess.run(
        [*CLI, "--model", str(missing), "--backend", "reference"],
        capture_output=True,
        text=True,
        timeout=WAIT * 5,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "no such file" in lines[0], done.stderr


def _engine(parameters: int, device: str = "cpu", tp: int = 1):
    config = SimpleNamespace(num_parameters=lambda active=False: parameters)
    model = SimpleNamespace(config=config, device=torch.device(device), tp=SimpleNamespace(size=tp))
    return SimpleNamespace(model=model)


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_the_front_end_gets_a_core_when_the_model_costs_less_per_token_than_it(cores, monkeypatch):
    # synthetic:tiny's forward (~150 k parameters) costs less CPU per token than the front end's
    # work: it leaves a core to the front end; SmolLM2-135M keeps every core, as offline.
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    tiny, default = _engine(151_872), _engine(134_515_008)
    assert core_process.core_threads(tiny) == max(1, cores - 1)
    assert core_process.core_threads(default) == cores
    assert core_process.core_threads(default, requested=3) == 3  # --core-threads
    # the threshold scales with the cores the front end would leave idle: f * (cores - 1)
    edge = core_process.FRONT_END_S_PER_TOKEN * 15 * core_process.CORE_FLOPS_PER_S / 2
    assert core_process.core_threads(_engine(int(edge))) == (15 if cores == 16 else cores)
    assert core_process.core_threads(_engine(151_872, "cuda")) is None  # no CPU forward
    assert core_process.core_threads(_engine(151_872, tp=2)) is None  # TP ranks split cores


def test_the_core_steps_on_the_threads_it_chose_or_was_given():
    config = EngineConfig(model=TINY, backend="reference", device="cpu")
    cores = available_cores()
    for asked, threads in ((None, max(1, cores - 1)), (2, 2)):
        client = EngineClient.spawn(config, core_threads=asked)
        try:
            plural = "s" if threads > 1 else ""
            assert client.info.description.endswith(f", {threads} CPU thread{plural}")
        finally:
            client.stop()


def test_core_threads_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="core_threads"):
            ServerSettings(core_threads=bad)
    assert ServerSettings(core_threads=4).core_threads == 4
    parser = cli_args.build_parser()
    assert parser.parse_args(["--http", "--core-threads", "3"]).core_threads == 3
    assert parser.parse_args(["--http"]).core_threads is None


def test_the_channel_refuses_python_objects():
    with pytest.raises(TypeError):
        channel.encode(StepOutputs([SampleDelta("id", 0, [1, 2], None, object(), None)], [], []))
    logprobs = (TokenLogprob(1, -0.5, ((1, -0.5),)),)
    message = StepOutputs([SampleDelta("id", 0, [1, 2], "stop", None, logprobs)], ["r"], [7])
    assert channel.decode(channel.encode(message)) == message


def test_every_frame_on_the_wire_is_msgpack(monkeypatch):
    sent: list[bytes] = []
    send_bytes = multiprocessing.connection.Connection.send_bytes

    def recording(self, buf, *args):
        sent.append(bytes(buf))
        return send_bytes(self, buf, *args)

    monkeypatch.setattr(multiprocessing.connection.Connection, "send_bytes", recording)
    with ServerThread(tiny_engine()) as s:
        body = {
            "model": TINY,
            "messages": user("hi"),
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
            "stop": ["zz"],
            "logit_bias": {"7": 1.5},
            "n": 2,
        }
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=WAIT)
        assert r.status_code == 200, r.text
        httpx.get(s.url + "/metrics", timeout=WAIT)
    frames = [msgpack.unpackb(data, strict_map_key=False) for data in sent]
    kinds = {frame[0] for frame in frames}
    assert {Add.TAG, Added.TAG, StepOutputs.TAG, Stats.TAG, Stop.TAG} <= kinds
    (add,) = next(m for m in map(channel.decode, sent) if isinstance(m, Add)).requests
    params = add.params
    assert params.n == 2 and params.logit_bias == {7: 1.5} and params.stop == ()
    for data in sent:  # every message is one msgpack value and nothing else
        unpacker = msgpack.Unpacker(strict_map_key=False)
        unpacker.feed(data)
        assert len(list(unpacker)) == 1 and not data.startswith(b"\x80")  # (pickle's PROTO)


def test_requests_submitted_together_reach_the_core_in_one_frame_before_one_step():
    """A burst submitted in one event-loop iteration is one Add message (then an abort after
    it): the core admits all of it before stepping, as the offline engine gets its batch."""
    running_at_steps: list[int] = []
    engine = tiny_engine()
    client = in_thread(engine, after_step=lambda e: running_at_steps.append(e.stats().num_running))
    frames: list = []
    send_frame = client.channel.send_frame

    def recording(data: bytes) -> None:
        frames.append(channel.decode(data))
        send_frame(data)

    client.channel.send_frame = recording
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def scenario() -> None:
        client.start()
        prompt = {"prompt_ids": [1, 2, 3]}
        streams = await asyncio.gather(*(client.submit(f"r{i}", prompt, params) for i in range(6)))
        for s in streams:
            while await s.next_batch():
                pass
        await client.aclose()

    asyncio.run(scenario())
    adds = [m for m in frames if isinstance(m, Add)]
    assert len(adds) == 1 and [a.request_id for a in adds[0].requests] == [
        f"r{i}" for i in range(6)
    ]
    assert running_at_steps[0] == 6


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_chunks_are_the_bytes_the_response_models_make(kind, include_usage):
    """The per-token chunk is built as plain data: the same JSON as the pydantic models'."""
    fmt_type = ChatFormat if kind == "chat" else CompletionFormat
    lp = (TokenLogprob(5, -0.25, ((5, -0.25), (9, -float("inf")))),)
    cases = [
        (StreamOutput('h\u00e9"l\\lo\n\u4e16', [5], False, None), None),
        (StreamOutput("", [5], True, FinishReason.STOP), "stop"),
        (StreamOutput("x", [5], False, None, logprobs=lp), None),
    ]
    for index, (out, finish) in enumerate(cases):
        fmt = fmt_type("id-1", "m", include_usage, lambda t: f"<{t}>", 3)
        want_fmt = fmt_type("id-1", "m", include_usage, lambda t: f"<{t}>", 3)
        want_fmt.meta = fmt.meta
        logprobs = want_fmt.logprobs(index, out)
        if kind == "chat":
            choice = ChatChunkChoice(
                index=index, delta=Delta(content=out.text or None), finish_reason=finish,
                logprobs=logprobs,
            )  # fmt: skip
            model = ChatCompletionChunk(**fmt.meta, choices=[choice])
        else:
            choice = CompletionChoice(
                index=index, text=out.text, finish_reason=finish, logprobs=logprobs
            )
            model = Completion(**fmt.meta, choices=[choice])
        want = model.model_dump_json(exclude=None if include_usage else {"usage"})
        assert fmt.delta(index, out, finish) == want


def engine_samples(params: SamplingParams, prompt: str) -> tuple[list[str], list[str], int]:
    """Texts and finish reasons per sample, and tokens made, from the engine alone (which
    matches stop strings itself)."""
    engine = tiny_engine()
    engine.add_request(prompt, params)
    texts, reasons, tokens = [""] * params.n, [""] * params.n, 0
    for out in engine.run_until_done():
        texts[out.index] += out.text
        tokens += len(out.token_ids)
        if out.finished:
            reasons[out.index] = out.finish_reason.value
    return texts, reasons, tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_matched_in_the_front_end_give_the_engines_answers(stream):
    """n = 3 seeded samples: the front end's detokenization and stop strings (and the aborts
    they send, sample 0 excepted) give exactly what the engine gives on its own."""
    prompt, base = "Stop somewhere", dict(n=3, seed=7, temperature=1.0, max_tokens=24)
    free, _, _ = engine_samples(SamplingParams(**base), prompt)
    stop = free[1][4:6]  # hit by sample 1 at least; maybe by others, maybe not
    texts, reasons, tokens = engine_samples(SamplingParams(**base, stop=[stop]), prompt)
    assert "stop" in reasons
    body = {"model": TINY, "prompt": prompt, **base, "stop": [stop], "stream": stream}
    body["stream_options"] = {"include_usage": True} if stream else None
    with ServerThread(tiny_engine()) as s:
        got_texts, got_reasons = [""] * 3, [""] * 3
        if stream:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=WAIT) as r:
                chunks = [json.loads(d) for d in sse_data(r) if d != "[DONE]"]
            for c in chunks[:-1]:
                (choice,) = c["choices"]
                got_texts[choice["index"]] += choice["text"]
                got_reasons[choice["index"]] = choice["finish_reason"] or ""
            usage = chunks[-1]["usage"]
        else:
            answer = httpx.post(s.url + "/v1/completions", json=body, timeout=WAIT).json()
            for choice in answer["choices"]:
                got_texts[choice["index"]] = choice["text"]
                got_reasons[choice["index"]] = choice["finish_reason"]
            usage = answer["usage"]
        assert s.engine_loop.wait_for(lambda: s.engine_loop.num_live == 0, WAIT)
        assert s.engine_loop.run_in_engine(lambda e: e.pool.num_used).result(WAIT) == 0
    assert (got_texts, got_reasons) == (texts, reasons)
    assert usage["completion_tokens"] == tokens


def test_a_stop_string_on_the_first_sample_ends_it_in_the_core_too():
    """n = 2: a stop string the front end matches on sample 0 aborts that sample alone in the
    core (its engine id is the request's own), which then makes no more of its tokens, while
    sample 1 runs to its end."""
    prompt = "Stop somewhere"
    base = dict(n=2, seed=7, temperature=1.0, max_tokens=40, ignore_eos=True)
    free, _, _ = engine_samples(SamplingParams(**base), prompt)
    stop = next(
        piece
        for piece in (free[0][i : i + 3] for i in range(2, 30))
        if piece.strip() and piece not in free[1]
    )
    texts, reasons, _ = engine_samples(SamplingParams(**base, stop=[stop]), prompt)
    assert reasons == ["stop", "length"]
    body = {"model": TINY, "prompt": prompt, **base, "stop": [stop]}
    with ServerThread(tiny_engine()) as s:
        answer = httpx.post(s.url + "/v1/completions", json=body, timeout=WAIT).json()
        assert s.engine_loop.wait_for(lambda: s.engine_loop.num_live == 0, WAIT)
        made = s.engine_loop.run_in_engine(lambda e: e.stats().num_generated_tokens).result(WAIT)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == texts
    assert [c["finish_reason"] for c in choices] == reasons
    assert made - base["max_tokens"] < base["max_tokens"], "sample 0 ran on to max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_stop_strings_in_the_front_end_as_in_the_engine(stream):
    """A stop string that shows up before min_tokens ids does not end the request, whether the
    engine matches it (alone) or the front end does (served)."""
    prompt, base = "Keep going", dict(seed=3, temperature=1.0, max_tokens=16, min_tokens=8)
    free, _, _ = engine_samples(SamplingParams(**base), prompt)
    stop = free[0][:2]  # found at once, within the first min_tokens ids
    texts, reasons, _ = engine_samples(SamplingParams(**base, stop=[stop]), prompt)
    assert texts[0].startswith(stop)  # the engine let it pass
    body = {"model": TINY, "prompt": prompt, **base, "stop": [stop], "stream": stream}
    with ServerThread(tiny_engine()) as s:
        if stream:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=WAIT) as r:
                chunks = [json.loads(d) for d in sse_data(r) if d != "[DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            answer = httpx.post(s.url + "/v1/completions", json=body, timeout=WAIT).json()
            text, reason = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
        assert s.engine_loop.wait_for(lambda: s.engine_loop.num_live == 0, WAIT)
    assert ([text], [reason]) == (texts, reasons)


def test_a_request_id_submitted_twice_at_once_is_refused_and_the_first_keeps_its_answer():
    """Two requests under one id in one burst (two clients sending one X-Request-Id): before,
    the second's admission took the first's place in the client's map, so the first's answer
    went to the second's handler and the first hung for good. Now the second is refused at
    once and the first gets its own answer."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    solo_client = in_thread(tiny_engine())

    async def answer(client, request_id: str, prompt_ids: list[int]) -> list[int]:
        stream = await client.submit(request_id, {"prompt_ids": prompt_ids}, params)
        tokens = []
        while batch := await stream.next_batch():
            tokens += [t for out in batch for t in out.token_ids]
        return tokens

    async def solo() -> list[int]:
        solo_client.start()
        try:
            return await answer(solo_client, "a", [1, 2, 3])
        finally:
            await solo_client.aclose()

    want = asyncio.run(solo())
    client = in_thread(tiny_engine())

    async def scenario():
        client.start()
        try:
            first, second = await asyncio.wait_for(
                asyncio.gather(
                    answer(client, "dup", [1, 2, 3]),
                    answer(client, "dup", [7, 8, 9, 10]),
                    return_exceptions=True,
                ),
                WAIT,
            )
        finally:
            await client.aclose()
        return first, second

    first, second = asyncio.run(scenario())
    assert first == want and len(want) == 6
    assert isinstance(second, ValueError) and "already in use" in str(second)
