"""The HTTP server under hostile or careless clients: big prompts are
templated and tokenized off the engine thread, bodies and heads are bounded and must arrive in
time, connections are capped, a client that leaves is not an ERROR, 5xx bodies carry the request
id and no internals, /metrics survives a dead engine, HEAD /health works."""

from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import pytest
from support.serving import ServerThread

from pagedkern.engine import Engine, EngineConfig
from pagedkern.serving.http.settings import ServerSettings

TINY = "synthetic:tiny"
WAIT = 60  # safety net for every wait (seconds); nothing here waits on timing to pass


def tiny_engine(**overrides) -> Engine:
    config = dict(model=TINY, backend="reference", device="cpu", num_blocks=1024, block_size=4)
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


def completion(prompt, **extra) -> dict:
    return {"model": TINY, "prompt": prompt, "max_tokens": 2, **extra}


def post(server: ServerThread, body, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT, **kwargs)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def still_serving(server: ServerThread) -> None:
    r = post(server, completion("still there?"))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# --- defect 3: big prompts ---------------------------------------------------------------------


def streams_meanwhile(method: str, is_big, send) -> httpx.Response:
    """While send(server) has the tokenizer's `method` (encode or decode) working on a big
    input (is_big(its first argument)), another stream keeps receiving tokens: that call waits
    for three more of them (on the event loop it would wait forever: the safety net then fails
    the test). Returns send's response."""
    engine = tiny_engine()
    events: list[str] = []
    arrived = threading.Condition()
    work = getattr(engine.tokenizer, method)

    def slow_work(arg, *args, **kwargs):
        if not is_big(arg):
            return work(arg, *args, **kwargs)
        events.append("work starts")
        with arrived:
            start = events.count("token")
            arrived.wait_for(lambda: events.count("token") >= start + 3, timeout=20)
        events.append("work ends")
        return work(arg, *args, **kwargs)

    setattr(engine.tokenizer, method, slow_work)
    with ServerThread(engine) as s:
        body = completion("go", max_tokens=400, ignore_eos=True, stream=True)
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=WAIT) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            next(lines)
            big_answer: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: big_answer.append(send(s)))
            sender.start()
            for _ in lines:
                with arrived:
                    events.append("token")
                    arrived.notify_all()
                if "work ends" in events:
                    break
            sender.join(WAIT)
        assert big_answer, events
        during = events[events.index("work starts") : events.index("work ends")]
        assert during.count("token") >= 3, events
        still_serving(s)
    return big_answer[0]


def test_tokenizing_a_big_prompt_does_not_stall_another_stream():
    big = "word " * 2000  # under the character bound, so it really gets tokenized
    r = streams_meanwhile(
        "encode", lambda text: big.strip() in text, lambda s: post(s, completion(big))
    )
    assert r.status_code in (200, 400), r.text


def test_a_10_mb_body_is_413_and_a_10_mb_prompt_is_refused_before_tokenizing():
    engine = tiny_engine()
    encoded_lengths: list[int] = []
    encode = engine.tokenizer.encode

    def recording_encode(text: str, *args, **kwargs):
        encoded_lengths.append(len(text))
        return encode(text, *args, **kwargs)

    engine.tokenizer.encode = recording_encode
    huge = "x" * 10_000_000
    with ServerThread(engine) as s:  # default body limit: 8 MiB
        assert_openai_error(post(s, completion(huge)), 413, "request_too_large")
        chunked = (
            json.dumps(completion(huge)).encode()[i : i + 2**20] for i in range(0, 10**7, 2**20)
        )
        r = httpx.post(s.url + "/v1/completions", content=chunked, timeout=WAIT)
        assert_openai_error(r, 413, "request_too_large")  # no Content-Length: counted as read
        still_serving(s)
    with ServerThread(engine, settings=ServerSettings(max_body_bytes=32 * 2**20)) as s:
        error = assert_openai_error(post(s, completion(huge)), 400, "context_length_exceeded")
        assert error["param"] == "prompt"
        chat = {"model": TINY, "messages": [{"role": "user", "content": huge}]}
        r = httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=WAIT)
        assert_openai_error(r, 400, "context_length_exceeded")
        still_serving(s)
    assert max(encoded_lengths) < 1000  # the 10 MB texts were never tokenized


def test_tokenizing_many_text_bad_words_does_not_stall_another_stream():
    words = [f"word{i}" for i in range(60)] + ["zebra"]  # within the bounds, a big total
    body = completion("hi", bad_words=words)
    r = streams_meanwhile("encode", lambda text: "zebra" in text, lambda s: post(s, body))
    assert r.status_code == 200, r.text


def test_text_bad_words_past_their_bounds_are_refused_before_tokenizing():
    """More words than SamplingParams can hold (each makes up to two sequences), or a word
    whose characters alone make more than 256 tokens, is refused on both routes without
    tokenizing it (for a few MB of them: seconds of the event loop's time)."""
    engine = tiny_engine()
    encoded: list[str] = []
    encode = engine.tokenizer.encode

    def recording_encode(text: str, *args, **kwargs):
        encoded.append(text)
        return encode(text, *args, **kwargs)

    engine.tokenizer.encode = recording_encode
    per_token = engine.tokenizer.max_token_chars
    assert per_token is not None
    long_word = "b" * (256 * per_token + 1)
    cases = [(["ab"] * 40_000, "at most 32768 words as text, got 40000"), (["x", long_word], "[1]")]
    chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with ServerThread(engine) as s:
        for path, body in (("/v1/completions", completion("hi")), ("/v1/chat/completions", chat)):
            for words, message in cases:
                r = httpx.post(s.url + path, json={**body, "bad_words": words}, timeout=WAIT)
                error = assert_openai_error(r, 400)
                assert error["param"] == "bad_words" and message in error["message"], error
        still_serving(s)
    assert "ab" not in encoded and long_word not in encoded


@pytest.mark.parametrize("request_kind", ["prompt", "messages", "detokenize"])
def test_big_tokenize_and_detokenize_requests_do_not_stall_another_stream(request_kind):
    big = "zebra " * 2000

    def send(s: ServerThread) -> httpx.Response:
        path = "/detokenize" if request_kind == "detokenize" else "/tokenize"
        body = {
            "prompt": {"prompt": big},
            "messages": {"messages": [{"role": "user", "content": big}]},
            "detokenize": {"tokens": [5] * 5000},
        }[request_kind]
        return httpx.post(s.url + path, json={"model": TINY, **body}, timeout=WAIT)

    if request_kind == "detokenize":
        r = streams_meanwhile("decode", lambda ids: len(ids) == 5000, send)
    else:
        r = streams_meanwhile("encode", lambda text: big.strip() in text, send)
    assert r.status_code == 200, r.text


def test_prompt_token_ids_outside_the_vocabulary_are_400():
    with ServerThread(tiny_engine()) as s:
        for ids in ([512], [-1], [2**31 - 1], [2**63], [1, 2, 9223372036854775808]):
            assert_openai_error(post(s, completion(ids)), 400)
        still_serving(s)


# --- defect 6: connection hygiene --------------------------------------------------------------


def raw_connection(server: ServerThread) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_client_trickling_its_headers_is_disconnected():
    settings = ServerSettings(header_timeout=0.5)
    with ServerThread(tiny_engine(), settings=settings) as s, raw_connection(s) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert read_all(sock) == b""  # closed by the server (before the fix: recv times out)
        still_serving(s)


def test_a_body_that_does_not_arrive_in_time_is_408():
    settings = ServerSettings(body_timeout=0.5)
    with ServerThread(tiny_engine(), settings=settings) as s, raw_connection(s) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 408"), head
        still_serving(s)


def test_a_huge_request_head_is_refused():
    with ServerThread(tiny_engine(), settings=ServerSettings(max_header_bytes=8192)) as s:
        r = httpx.get(s.url + "/health", headers={"X-Big": "a" * 20000}, timeout=WAIT)
        assert r.status_code in (400, 431)
        still_serving(s)


def test_connections_beyond_the_cap_get_503():
    with ServerThread(tiny_engine(), settings=ServerSettings(max_connections=2)) as s:
        open_ones = []
        try:
            for status in (b"200", b"200", b"503"):  # kept open (keep-alive) one after another
                sock = raw_connection(s)
                open_ones.append(sock)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 " + status)
        finally:
            for sock in open_ones:
                sock.close()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_leaving_mid_body_is_not_an_error():
    records = Records()
    with ServerThread(tiny_engine()) as s:
        loggers = [logging.getLogger(n) for n in ("uvicorn.error", "pagedkern")]
        for logger in loggers:
            logger.addHandler(records)
        try:
            with raw_connection(s) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
                )
            still_serving(s)  # the abandoned request has been handled meanwhile
            s.server.should_exit = True
            s.thread.join(WAIT)
        finally:
            for logger in loggers:
                logger.removeHandler(records)
    errors = [r.getMessage() for r in records.records if r.levelno >= logging.ERROR]
    assert errors == []


def test_5xx_bodies_name_the_request_id_not_the_internals():
    engine = tiny_engine()
    run = engine.runner.run

    def failing_run(*args, **kwargs):
        engine.runner.run = run  # fail one step only
        raise RuntimeError("secret internals")

    with ServerThread(engine) as s:
        engine.runner.run = failing_run
        r = post(s, completion("fail"), headers={"X-Request-Id": "abc-42"})
        error = assert_openai_error(r, 500, "engine_error")
        assert "secret" not in error["message"] and "abc-42" in error["message"]
        engine.runner.run = failing_run
        body = completion("fail", stream=True)
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=WAIT) as r:
            text = r.read().decode()
        assert "engine_error" in text and "secret" not in text
        still_serving(s)


def test_a_dead_engine_keeps_its_gauges_and_head_health_works():
    broken = threading.Event()

    def maybe_fail(_engine: Engine) -> None:
        if broken.is_set():
            raise RuntimeError("injected failure")

    with ServerThread(tiny_engine(), after_step=maybe_fail) as s:
        assert httpx.head(s.url + "/health", timeout=WAIT).status_code == 200
        broken.set()
        r = post(s, completion("go", max_tokens=50, ignore_eos=True))
        assert r.status_code == 503 and "injected" not in r.text
        s.engine_loop.stop()  # the thread has ended: its state is readable
        metrics = httpx.get(s.url + "/metrics", timeout=WAIT).text
        assert "pagedkern_num_requests_running 1" in metrics  # the request it died holding
        assert "pagedkern_kv_blocks_total 1024" in metrics
        assert httpx.head(s.url + "/health", timeout=WAIT).status_code == 503


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_every_response_echoes_the_request_id(path):
    with ServerThread(tiny_engine()) as s:
        r = httpx.get(s.url + path, headers={"X-Request-Id": "trace-me.1"}, timeout=WAIT)
        assert r.headers["x-request-id"] == "trace-me.1"
        made_up = httpx.get(s.url + path, timeout=WAIT).headers["x-request-id"]
        assert len(made_up) >= 16
        bad = httpx.get(s.url + path, headers={"X-Request-Id": "a b\tc"}, timeout=WAIT)
        assert_openai_error(bad, 400)
