"""The OpenAI-compatible HTTP server on a loopback port: the official `openai` client gets the
engine's own answers (chat and completions, streamed and whole, with usage and finish
reasons); raw HTTP gets OpenAI-shaped errors with the right status while the server keeps
serving; a client that goes away aborts its request and frees its KV blocks; a full queue
answers 429; shutdown ends open streams with "abort"; a dead engine answers 503; the CLI serves
and exits cleanly; the default model answers the capital question with Paris.

Every wait is on an event (stream data, the engine loop's condition), with generous timeouts
only as safety nets."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading

import h11
import httpx
import jinja2
import pytest
from http_stack import openai
from support.serving import ServerThread
from uvicorn.protocols.http.h11_impl import RequestResponseCycle

from pagedkern.engine import Engine, EngineConfig, RequestRejected, SamplingParams
from pagedkern.serving.cli import main
from pagedkern.serving.core.client_errors import EngineUnavailable, QueueFull
from pagedkern.serving.http import request_parsing
from pagedkern.serving.http.app import admission_error
from pagedkern.serving.http.prompts import INLINE_PROMPT_CHARS, PromptPreparer
from pagedkern.serving.http.request_models import CompletionRequest

TINY = "synthetic:tiny"
WAIT = 60  # safety-net timeout (seconds) for every wait
LONG = 1800  # max_tokens of requests that must still be running when the test acts on them


def tiny_engine(**overrides) -> Engine:
    config = dict(
        model=TINY,
        backend="reference",
        device="cpu",
        num_blocks=1024,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


def check_pool(engine: Engine) -> None:
    engine.pool.check_invariants(engine.scheduler.block_tables())


def kv_used(server: ServerThread) -> int:
    """Blocks in use, read in the engine thread after checking the pool's invariants."""

    def read(engine: Engine) -> int:
        check_pool(engine)
        return engine.pool.num_used

    return server.engine_loop.run_in_engine(read).result(WAIT)


def finished(server: ServerThread, reason: str) -> int:
    return server.engine_loop.metrics.finished.get(reason, 0)


def sse_data(response: httpx.Response):
    """The data payloads of a Server-Sent Events response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(tiny_engine(), after_step=check_pool) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def solo():
    """The engine alone (no server): text and token count of one request."""
    engine = tiny_engine()

    def run(params: SamplingParams, **request) -> tuple[str, int]:
        outs = list(engine.stream(params=params, **request))
        return "".join(o.text for o in outs), sum(len(o.token_ids) for o in outs)

    run.tokenizer = engine.tokenizer
    return run


def greedy(n: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **extra)


def test_chat_whole_answer_is_the_engines(client, solo):
    r = client.chat.completions.create(
        model=TINY, messages=user("Hello there"), max_tokens=12, temperature=0
    )
    text, n = solo(greedy(12), messages=user("Hello there"))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    rendered = solo.tokenizer.apply_chat_template(user("Hello there"), add_generation_prompt=True)
    prompt = len(solo.tokenizer.encode(rendered))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt, n)
    assert r.usage.total_tokens == prompt + n


def test_chat_stream_chunks(client, solo):
    stream = client.chat.completions.create(
        model=TINY,
        messages=user("Stream this"),
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text, n = solo(greedy(10), messages=user("Stream this"))
    assert len({c.id for c in chunks}) == 1 and all(
        c.object == "chat.completion.chunk" for c in chunks
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == text
    assert len([c for c in content if c]) >= 2  # token by token, not one piece
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_whole_and_streamed(client, solo):
    text, n = solo(greedy(9), prompt="The quick brown fox")
    whole = client.completions.create(
        model=TINY, prompt="The quick brown fox", max_tokens=9, temperature=0
    )
    assert whole.object == "text_completion" and whole.choices[0].text == text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == n
    streamed = client.completions.create(
        model=TINY, prompt="The quick brown fox", max_tokens=9, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text
    ids = solo.tokenizer.encode("The quick brown fox")
    by_ids = client.completions.create(model=TINY, prompt=ids, max_tokens=9, temperature=0)
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(ids)


def test_default_max_tokens_stop_strings_and_seeds(client, solo):
    # /v1/completions defaults to 16 tokens, as OpenAI's does
    r = client.completions.create(
        model=TINY, prompt="Count", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16
    full, _ = solo(greedy(24), prompt="Stop somewhere")
    stop = full[8:11]
    r = client.completions.create(
        model=TINY, prompt="Stop somewhere", max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
    kwargs = dict(
        model=TINY, messages=user("Surprise me"), max_tokens=12, temperature=1.0, top_p=0.9
    )
    a = client.chat.completions.create(**kwargs, seed=1234)
    b = client.chat.completions.create(**kwargs, seed=1234)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert (
        a.choices[0].message.content
        == solo(
            SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234),
            messages=user("Surprise me"),
        )[0]
    )


def test_models_health_metrics(server, client):
    client.completions.create(model=TINY, prompt="hi", max_tokens=2)  # a first token to count
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY]
    assert client.models.retrieve(TINY).id == TINY
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in (
        "pagedkern_num_requests_running 0",
        "pagedkern_num_requests_waiting 0",
        "pagedkern_kv_blocks_used 0",
        "pagedkern_time_to_first_token_seconds_bucket",
        "pagedkern_inter_token_latency_seconds_count",
        "pagedkern_generation_tokens_total",
    ):
        assert name in r.text
    counts = [int(n) for n in re.findall(r'first_token_seconds_bucket\{le="[^"]+"\} (\d+)', r.text)]
    assert len(counts) > 5 and counts == sorted(counts) and counts[-1] > 0  # cumulative


ok_chat = {"model": TINY, "messages": user("hi"), "max_tokens": 2}
BAD = [
    ("chat", b"{not json", 400, None, "invalid_json"),
    ("chat", b"[1, 2]", 400, None, None),
    ("chat", {"messages": user("hi")}, 400, "model", "missing"),
    ("chat", {"model": TINY}, 400, "messages", "missing"),
    ("chat", {**ok_chat, "messages": []}, 400, "messages", None),
    ("chat", {**ok_chat, "messages": "hi"}, 400, "messages", None),
    (
        "chat",
        {**ok_chat, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
        None,
    ),
    ("chat", {**ok_chat, "messages": [{"role": "user"}]}, 400, "messages[0].content", "missing"),
    ("chat", {**ok_chat, "max_tokens": "8"}, 400, "max_tokens", None),
    ("chat", {**ok_chat, "max_tokens": 0}, 400, "max_tokens", None),
    ("chat", {**ok_chat, "temperature": -1}, 400, "temperature", None),
    ("chat", {**ok_chat, "top_p": 0}, 400, "top_p", None),
    ("chat", {**ok_chat, "stream": "yes"}, 400, "stream", None),
    ("chat", {**ok_chat, "n": 65}, 400, "n", None),
    ("chat", {**ok_chat, "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ("chat", {**ok_chat, "frequency_penalty": -3}, 400, "frequency_penalty", None),
    ("chat", {**ok_chat, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("chat", {**ok_chat, "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
    ("chat", {**ok_chat, "logit_bias": {"5": 200}}, 400, "logit_bias", None),
    ("chat", {**ok_chat, "allowed_token_ids": [10**6]}, 400, "allowed_token_ids", None),
    ("chat", {**ok_chat, "bad_words": [[1, 10**6]]}, 400, "bad_words", None),
    ("chat", {**ok_chat, "min_p": 2}, 400, "min_p", None),
    ("chat", {**ok_chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("chat", {**ok_chat, "top_logprobs": 2}, 400, "top_logprobs", None),
    (
        "chat",
        {
            **ok_chat,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "objekt"}},
            },
        },
        400,
        "response_format",
        None,
    ),
    ("chat", {**ok_chat, "response_format": {"type": "yaml"}}, 400, "response_format", None),
    ("chat", {**ok_chat, "tools": [{"type": "function"}]}, 400, "tools[0].function", None),
    ("chat", {**ok_chat, "tool_choice": "auto"}, 400, "tool_choice", None),
    ("chat", {**ok_chat, "functions": [{}]}, 400, "functions", None),
    ("chat", {**ok_chat, "stop": [""]}, 400, "stop", None),
    (  # (the newer name would be ignored)
        "chat",
        {**ok_chat, "max_tokens": 3, "max_completion_tokens": -5},
        400,
        "max_completion_tokens",
        None,
    ),
    ("chat", {**ok_chat, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("chat", {**ok_chat, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    (
        "chat",
        {**ok_chat, "messages": user("hi " * 3000)},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "chat",
        {**ok_chat, "stream": True, "messages": user("hi " * 3000)},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("completions", {"model": TINY, "prompt": ["a", ""]}, 400, "prompt", None),
    ("completions", {"model": TINY, "prompt": "x", "best_of": 2}, 400, "best_of", None),
    ("completions", {"model": TINY, "prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("completions", {"model": TINY, "prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("completions", {"model": TINY, "prompt": "x", "tools": []}, 400, "tools", None),
    (
        "completions",
        {"model": TINY, "prompt": "x", "parallel_tool_calls": False},
        400,
        "parallel_tool_calls",
        None,
    ),
    ("completions", {"model": TINY, "prompt": ""}, 400, "prompt", None),
    ("completions", {"model": TINY, "prompt": []}, 400, "prompt", None),
    (
        "completions",
        {"model": TINY, "prompt": "x", "echo": True, "stream": True},
        400,
        "echo",
        None,
    ),
]


@pytest.mark.parametrize("endpoint,body,status,param,code", BAD)
def test_bad_requests_get_openai_errors(server, endpoint, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/v1/{endpoint.replace('chat', 'chat/completions')}", content=content
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code:
        assert error["code"] == code


def test_admission_failures_map_to_statuses():
    rejected = RequestRejected("too long")
    cases = [
        (QueueFull("8 waiting"), 429, "queue_full"),
        (rejected, 400, "context_length_exceeded"),
        (ValueError("the prompt is empty"), 400, None),
        (jinja2.TemplateError("roles must alternate"), 400, None),
        (EngineUnavailable("stopped"), 503, "engine_unavailable"),
        (TypeError("stop must be a list"), 400, None),
        (RuntimeError("secret internals"), 500, "internal_error"),
    ]
    for exc, status, code in cases:
        error = admission_error(exc, "messages", "req-7")
        assert (error.status, error.code) == (status, code), exc
    assert "secret" not in error.message and "req-7" in error.message  # 5xx: the id, no internals


def test_only_small_prompts_are_prepared_on_the_event_loop():
    small, big = "w" * INLINE_PROMPT_CHARS, "w" * (INLINE_PROMPT_CHARS + 1)
    assert PromptPreparer.is_small([{"prompt": small}, {"prompt_ids": []}])
    assert not PromptPreparer.is_small([{"prompt": big}])
    assert not PromptPreparer.is_small([{"prompt": small}, {"prompt_ids": [1]}])  # in all
    assert not PromptPreparer.is_small([{"prompt_ids": [1] * (INLINE_PROMPT_CHARS + 1)}])
    messages = [{"role": "user", "content": "hi"}] * (INLINE_PROMPT_CHARS // 64)
    assert not PromptPreparer.is_small([{"messages": messages}])  # a template per message
    assert PromptPreparer.is_small([{"messages": messages[:4]}])


def test_only_small_bodies_are_validated_on_the_event_loop(monkeypatch):
    threads = []

    def parse(model, body):
        threads.append(threading.get_ident())
        return model.model_validate_json(body)

    monkeypatch.setattr(request_parsing, "parse", parse)

    async def both() -> list:
        small = json.dumps({"model": "m", "prompt": "w" * 100}).encode()
        big = json.dumps({"model": "m", "prompt": "w" * request_parsing.INLINE_BODY_BYTES}).encode()
        return [
            await request_parsing.parse_off_the_loop(CompletionRequest, body)
            for body in (small, big)
        ]

    small, big = asyncio.run(both())
    assert (len(small.prompt), len(big.prompt)) == (100, request_parsing.INLINE_BODY_BYTES)
    assert threads[0] == threading.get_ident() != threads[1]


def test_routes_and_methods_errors_and_still_serving(server, client):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=user("hi"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY, messages=user("hi"), temperature=7)
    r = client.chat.completions.create(model=TINY, messages=user("still there?"), max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert kv_used(server) == 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted = finished(server, "abort")
    body = {
        "model": TINY,
        "messages": user("a long one"),
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=WAIT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r)
        received = [json.loads(next(data)) for _ in range(4)]  # role chunk + 3 tokens
        assert received[-1]["choices"][0]["finish_reason"] is None
    # the connection is closed: the server aborts the request at its next step
    loop = server.engine_loop
    assert loop.wait_for(
        lambda: finished(server, "abort") == aborted + 1 and loop.num_live == 0, WAIT
    )
    assert kv_used(server) == 0


def test_streamed_body_chunks_bypass_h11_with_its_framing(server, monkeypatch):
    """connection.ChunkWriter writes a stream's event chunks itself: h11 sees no non-empty Data
    event, and an h11 client parses the raw response into the whole event stream (this pins
    h11's rule the writer follows: an HTTP/1.1 response without Content-Length or
    Transfer-Encoding is framed chunked)."""
    data_events = []
    send = h11.Connection.send

    def counting(conn, event):
        if isinstance(event, h11.Data) and event.data:
            data_events.append(event)
        return send(conn, event)

    monkeypatch.setattr(h11.Connection, "send", counting)
    body = json.dumps(
        {
            "model": TINY,
            "prompt": "hi",
            "max_tokens": 5,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body)
        )
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))
    conn.receive_data(raw)
    events = []
    while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        events.append(event)
        if isinstance(event, h11.EndOfMessage):
            break
    assert isinstance(events[0], h11.Response) and events[0].status_code == 200
    assert isinstance(events[-1], h11.EndOfMessage)
    text = b"".join(e.data for e in events if isinstance(e, h11.Data)).decode()
    payloads = [e[len("data: ") :] for e in text.split("\n\n") if e]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert data_events == []  # (uvicorn's own path sends every chunk as h11 Data)


def test_an_http_10_stream_is_delimited_by_the_close_not_chunked(server):
    """h11 frames the body of an HTTP/1.0 request's response by closing the connection: no
    chunk sizes; ChunkWriter then leaves every part to uvicorn's send (the other half of the
    rule it follows)."""
    body = json.dumps(
        {
            "model": TINY,
            "prompt": "hi",
            "max_tokens": 5,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert payload.startswith(b"data: {") and payload.endswith(b"data: [DONE]\n\n")
    events = [e for e in payload.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert sum(1 for t in texts if t) >= 3  # the tokens, each its own event


def test_streamed_tokens_are_written_by_the_frame_handler_not_the_asgi_send(
    server, client, monkeypatch
):
    """One stream's unfinished outputs go from the frame handler straight to its connection
    (streaming.py's direct path): uvicorn's send carries only the end."""
    body_sends = []
    send = RequestResponseCycle.send

    async def counting(cycle, message):
        if message["type"] == "http.response.body":
            body_sends.append(message.get("body", b""))
        await send(cycle, message)

    monkeypatch.setattr(RequestResponseCycle, "send", counting)
    chunks = list(
        client.completions.create(
            model=TINY,
            prompt="a story",
            max_tokens=24,
            temperature=0,  # (sampled, some draws held most tokens' text back: 8 of 24)
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 24
    texts = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) >= 12  # (most tokens have text: the count below means something)
    assert len(body_sends) <= 4  # finish + usage, [DONE], the end; (before: one per token)


def test_a_request_id_is_in_use_while_any_prompt_sent_under_it_runs(server):
    """Whichever of a one-prompt and a two-prompt request under one X-Request-Id comes first,
    the other is refused while the first runs (each prompt of a request runs as an engine
    request of its own), and takes the id once the first has ended."""
    url = server.url + "/v1/completions"
    one, two = {"model": TINY, "prompt": "hi"}, {"model": TINY, "prompt": ["hi", "yo"]}
    for k, (running, reusing) in enumerate([(one, two), (two, one)]):
        same_id = {"X-Request-Id": f"dup-{k}"}
        body = {**running, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, headers=same_id, timeout=WAIT) as r:
            events = sse_data(r)  # (kept: a dropped one would close the response)
            next(events)  # it runs
            refused = httpx.post(url, json=reusing, headers=same_id, timeout=WAIT)
            assert refused.status_code == 400, refused.text
            assert "already in use" in refused.json()["error"]["message"]
        assert server.engine_loop.wait_for(lambda: server.engine_loop.num_live == 0, WAIT)
        assert httpx.post(url, json=reusing, headers=same_id, timeout=WAIT).status_code == 200


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server):
    aborted = finished(server, "abort")
    loop = server.engine_loop

    async def go() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as http:
            body = {**ok_chat, "max_tokens": LONG, "ignore_eos": True}
            task = asyncio.ensure_future(http.post(server.url + "/v1/chat/completions", json=body))
            running = await asyncio.to_thread(loop.wait_for, lambda: loop.num_live == 1, WAIT)
            assert running
            task.cancel()  # the client gives up: httpx closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert loop.wait_for(
        lambda: finished(server, "abort") == aborted + 1 and loop.num_live == 0, WAIT
    )
    assert kv_used(server) == 0


def test_queue_full_answers_429_and_recovers():
    # one batch slot, one queue place: A runs, B waits, C is refused
    with ServerThread(tiny_engine(max_num_seqs=1), max_queue=1, after_step=check_pool) as s:
        body = {
            "model": TINY,
            "messages": user("first"),
            "max_tokens": LONG,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=WAIT) as a:
            a_data = sse_data(a)
            next(a_data), next(a_data)  # A is running (it has sampled a token)
            b_body = {**body, "messages": user("second"), "max_tokens": 4}
            with httpx.stream(
                "POST", s.url + "/v1/chat/completions", json=b_body, timeout=WAIT
            ) as b:
                b_data = sse_data(b)
                next(b_data)  # the role chunk: B is admitted (waiting for A's slot)
                c = httpx.post(
                    s.url + "/v1/chat/completions", json={**ok_chat, "messages": user("third")}
                )
                assert c.status_code == 429 and c.headers["retry-after"] == "1"
                assert c.json()["error"]["code"] == "queue_full"
                a.close()  # A's client leaves: B gets the slot and completes
                rest = list(b_data)
                assert rest[-1] == "[DONE]"
                assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert (
            'pagedkern_request_rejected_total{code="queue_full"} 1'
            in httpx.get(s.url + "/metrics").text
        )
        assert kv_used(s) == 0


def test_shutdown_ends_open_streams_with_abort():
    s = ServerThread(tiny_engine()).start()
    body = {
        "model": TINY,
        "prompt": "go on",
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=WAIT) as r:
        data = sse_data(r)
        next(data)
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        rest = list(data)
    stopper.join(WAIT)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    assert not s.thread.is_alive()
    engine = s.engine_loop.engine  # its thread has ended: safe to read here
    check_pool(engine)
    assert engine.pool.num_used == 0 and not engine.has_unfinished


def test_dead_engine_answers_503_and_ends_streams():
    broken = threading.Event()

    def maybe_fail(engine: Engine) -> None:
        if broken.is_set():
            raise RuntimeError("injected failure")

    with ServerThread(tiny_engine(), after_step=maybe_fail) as s:
        body = {
            "model": TINY,
            "prompt": "go",
            "max_tokens": LONG,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=WAIT) as r:
            data = sse_data(r)
            next(data)
            broken.set()
            rest = list(data)
        assert (
            rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_unavailable"
        )
        assert "injected failure" not in json.loads(rest[-2])["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"model": TINY, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(s.url + "/metrics").status_code == 200


# --- the CLI ------------------------------------------------------------------------------------

CLI = [sys.executable, "-m", "pagedkern.serving.cli"]


def test_cli_serves_http_until_interrupted():
    proc = subprocess.Popen(
        [*CLI, "--http", "--port", "0", "--model", TINY, "--backend", "reference"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # printed once the socket listens and the model is loaded
        match = re.search(r"serving 'synthetic:tiny' at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line + proc.stderr.read()
        url = match.group(1)
        assert httpx.get(url + "/health", timeout=WAIT).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=TINY, messages=user("hi"), max_tokens=3)
        assert r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--http", "hi"], "give no prompt"),
        (["--http", "--port", "70000"], "--port: expected a port in 0..65535"),
        (["--http", "--max-queue", "0"], "--max-queue: expected an integer >= 1"),
        (["--http", "--max-body-bytes", "-5"], "--max-body-bytes: expected an integer >= 1"),
        (["--http", "--body-timeout", "inf"], "--body-timeout: expected a finite number"),
        (["--http", "--chat-template", "/no/such.jinja"], "cannot read /no/such.jinja"),
        (["--http", "--chat-template", "{% if %}"], "--chat-template: line 1"),
        (["--http", "--port", "{taken}"], "in use"),
    ],
)
def test_cli_http_bad_arguments_exit_2(args, message, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        with pytest.raises(SystemExit) as exit_info:
            main([a.replace("{taken}", port) for a in args] + ["--model", TINY])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err


# --- the default model ----------------------------------------------------------------------


def test_default_model_answers_paris():
    # The default backend, whose bits are the same on every host; the reference backend's
    # torch int-pack GEMMs round differently on AVX2 and AVX-512 hosts, and a Xeon's greedy
    # answer there starts "L'Étoile".
    engine = Engine.from_config(EngineConfig(device="cpu"))
    with ServerThread(engine) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        question = user("What is the capital of France?")
        whole = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, max_tokens=20, temperature=0
        )
        assert whole.choices[0].message.content == "The capital of France is Paris."
        assert whole.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=question,
            max_tokens=20,
            temperature=0,
            stream=True,
        )
        pieces = [
            c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
        ]
        assert "".join(pieces) == "The capital of France is Paris." and len(pieces) > 3
