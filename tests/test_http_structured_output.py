"""Structured output under hostile clients, over a loopback server: response_format schemas are
compiled once per request on the engine core's compile threads (not on the front end's event
loop, not on the core's step loop, not once per sample), bounded in time and in concurrency,
and a schema the grammar engine cannot follow is a 400 naming response_format, with short
logs. Order is measured by events: each compile is held until the other clients have been
served (before the fix, the wait ran into its safety net)."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import llguidance
import pytest
from http_stack import openai  # noqa: F401 - skips this module without the HTTP stack
from support.serving import ServerThread

from pagedkern.engine import Engine, EngineConfig

TINY = "synthetic:tiny"
WAIT = 60  # safety net for every wait (seconds); nothing here waits on timing to pass
HELD = 20  # how long a held compile waits for what it waits for, at most


def tiny_engine(**overrides) -> Engine:
    config = dict(model=TINY, backend="reference", device="cpu", num_blocks=2048, block_size=4)
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


def big_schema(tag: str, fields: int = 1300) -> dict:
    """~80 KB: `fields` required date-time strings."""
    props = {f"{tag}_{i:04d}": {"type": "string", "format": "date-time"} for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def chat(schema: dict, **extra) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": "JSON, please"}]
    return {"model": TINY, "messages": messages, "max_tokens": 4, "response_format": fmt, **extra}


def post_chat(server: ServerThread, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=WAIT)


def settle(server: ServerThread) -> None:
    """Every request ended and every KV block back in the pool."""
    loop = server.engine_loop
    assert loop.wait_for(lambda: loop.num_live == 0, WAIT)
    assert loop.run_in_engine(lambda e: e.pool.num_used).result(WAIT) == 0


class Matchers:
    """llguidance.LLMatcher, watched: `built` counts the matchers built (each a whole compile),
    `most` the most built at once; `hold(fn)` makes the next compile (its first step,
    grammar_from_json_schema) wait until fn(the events since it started) holds (re-checked at
    every event)."""

    def __init__(self, real):
        self.real, self.built, self.building, self.most = real, 0, 0, 0
        self.changed = threading.Condition()
        self.events: list[str] = []
        self._hold = None

    def __call__(self, *args, **kwargs):
        with self.changed:
            self.built += 1
            self.building += 1
            self.most = max(self.most, self.building)
        try:
            return self.real(*args, **kwargs)
        finally:
            with self.changed:
                self.building -= 1
                self.events.append("built")
                self.changed.notify_all()

    def grammar_from_json_schema(self, *args, **kwargs):
        with self.changed:
            until, self._hold = self._hold, None
            if until is not None:
                self.events.append("compile starts")
                self.changed.notify_all()
                mark = len(self.events)
                self.changed.wait_for(lambda: until(self.events[mark:]), timeout=HELD)
                self.events.append("compile goes on")
        return self.real.grammar_from_json_schema(*args, **kwargs)

    def hold(self, until) -> None:
        self._hold = until

    def tick(self, event: str) -> None:
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def wait(self, event: str, count: int = 1) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.events.count(event) >= count, WAIT)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def matchers(monkeypatch) -> Matchers:
    watched = Matchers(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", watched)
    return watched


def stream_tokens(server: ServerThread, matchers: Matchers, stop: threading.Event):
    """A long stream in the background: each token it receives is a "token" event."""

    def run() -> None:
        body = {"model": TINY, "prompt": "go", "max_tokens": 5000, "ignore_eos": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=WAIT
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    matchers.tick("token")
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert matchers.wait("token", 2)
    return thread


def tokens_during_compile(events: list[str]) -> int:
    start = events.index("compile starts")
    return events[start : events.index("compile goes on", start)].count("token")


def test_n64_compiles_once_off_the_step_loop_while_another_stream_streams(matchers):
    """n = 64 with an 80 KB schema: one compile for the request (before: one per sample, each
    ~0.18 s on the default model: the core's step loop stopped for ~11 s), and while it runs
    the other stream keeps receiving tokens (the compile waits for three of them)."""
    with ServerThread(tiny_engine()) as s:
        stop = threading.Event()
        streamer = stream_tokens(s, matchers, stop)
        matchers.hold(lambda since: since.count("token") >= 3)
        r = post_chat(s, chat(big_schema("n64"), n=64))
        stop.set()
        streamer.join(WAIT)
        assert r.status_code == 200, r.text
        assert sorted(c["index"] for c in r.json()["choices"]) == list(range(64))
        assert tokens_during_compile(matchers.events) >= 3, matchers.events
        assert matchers.built == 1
        settle(s)


def test_16_schemas_compile_in_bounded_workers_while_the_front_end_answers(matchers):
    """16 concurrent requests, each with its own 80 KB schema: none is compiled on the front
    end's event loop (before: /health waited ~3 s and a stream stalled), at most
    grammar_compile_workers compile at once, and every one is answered 200."""
    engine = tiny_engine(grammar_compile_workers=2)
    with ServerThread(engine) as s:
        stop = threading.Event()
        streamer = stream_tokens(s, matchers, stop)
        matchers.hold(lambda since: "health" in since and since.count("token") >= 3)
        answers: dict[int, httpx.Response] = {}

        def send(k: int) -> None:
            answers[k] = post_chat(s, chat(big_schema(f"s{k}")))

        senders = [threading.Thread(target=send, args=(k,)) for k in range(16)]
        for sender in senders:
            sender.start()
        assert matchers.wait("compile starts")
        health = httpx.get(s.url + "/health", timeout=WAIT)
        matchers.tick("health")
        for sender in senders:
            sender.join(WAIT)
        stop.set()
        streamer.join(WAIT)
        assert health.status_code == 200
        events = matchers.events
        assert events.index("health") < events.index("compile goes on"), events
        assert tokens_during_compile(events) >= 3, events
        assert sorted(r.status_code for r in answers.values()) == [200] * 16, [
            r.text for r in answers.values() if r.status_code != 200
        ]
        assert matchers.built == 16 and matchers.most <= 2
        settle(s)


def test_a_compile_past_the_time_bound_is_a_400_naming_response_format(matchers):
    """A compile that runs past grammar_compile_timeout: the request is a 400 naming
    response_format (the compile is held until the client has that answer: it cannot be
    interrupted, it ends on its own), and the server serves on."""
    answer: list[httpx.Response] = []
    with ServerThread(tiny_engine(grammar_compile_timeout=0.01)) as s:
        matchers.hold(lambda _: bool(answer))
        sender = threading.Thread(
            target=lambda: answer.append(post_chat(s, chat(big_schema("slow"))))
        )
        sender.start()
        assert matchers.wait("compile starts")
        sender.join(WAIT)
        matchers.tick("answered")  # (the held compile sees the answer)
        r = answer[0]
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format" and "did not compile" in error["message"]
        assert matchers.wait("built")
        small = {"type": "object", "properties": {"x": {"type": "integer"}}}
        assert post_chat(s, chat(small)).status_code == 200
        settle(s)


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
UNFIT = {
    "a{1000000}": {"type": "string", "pattern": "^a{1000000}$"},
    "recursive required $ref": RECURSIVE,
    "1000 optional properties": OPTIONAL,
    "$ref #": {"$ref": "#"},
    "$ref cycle": CYCLE,
}


@pytest.mark.parametrize("stream", [False, True])
def test_schemas_the_grammar_engine_cannot_follow_are_a_400_with_short_logs(stream, caplog):
    """Schemas that compile but exceed llguidance's limits once generating (before: a 500
    engine_error, the whole grammar logged twice per sample) or admit no value (before: 200
    with content "", not JSON): 400 naming response_format, streamed or not, n = 64 included;
    no log line carries the grammar; the server serves on with KV back to 0."""
    caplog.set_level(logging.DEBUG)
    with ServerThread(tiny_engine()) as s:
        for name, schema in UNFIT.items():
            r = post_chat(s, chat(schema, n=64, stream=stream))
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["param"] == "response_format", (name, error)
            assert error["message"].startswith("response_format: ") and len(error["message"]) < 500
        ok = post_chat(s, chat({"type": "object", "properties": {"x": {"type": "integer"}}}))
        assert ok.status_code == 200, ok.text
        settle(s)
    longest = max((len(record.getMessage()) for record in caplog.records), default=0)
    assert longest < 2000, longest
    assert not any(json.dumps(OPTIONAL)[:200] in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "schema",
    [{"type": "integer", "maximum": 2**64}, {"enum": [-(2**63) - 1]},
     {"type": "string", "x-extra": 10**40}],
)  # fmt: skip
def test_an_integer_past_64_bits_in_a_schema_is_a_400_and_its_neighbours_are_served(schema):
    """Such an integer cannot cross to the engine core (msgpack carries 64 bits): before, the
    request's Add failed to encode, and it and every request sent in the same burst hung, the
    server then 503 for good. Now: a 400 naming response_format; the burst's other requests
    answered; KV back to 0."""
    with ServerThread(tiny_engine()) as s:
        results: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            body = chat(schema) if i == 0 else chat({"type": "object"})
            results[i] = post_chat(s, body)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert sorted(results) == [0, 1, 2, 3]
        assert results[0].status_code == 400, results[0].text
        error = results[0].json()["error"]
        assert error["param"] == "response_format" and "64-bit" in error["message"]
        assert all(results[i].status_code == 200 for i in (1, 2, 3))
        settle(s)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_and_allowed_token_ids_that_exclude_each_other_are_a_400(stream):
    """json_object with only "x" allowed: no token can start the document. Before: 200, each
    choice "" ending "stop" (the samplers' fallback token, here end-of-text). Now: a 400 naming
    response_format (streamed: the stream's error event); KV back to 0."""
    with ServerThread(tiny_engine()) as s:
        body = {
            "model": TINY, "prompt": "x", "n": 2, "temperature": 1, "seed": 1, "max_tokens": 10,
            "response_format": {"type": "json_object"}, "allowed_token_ids": [90],
            "stream": stream,
        }  # fmt: skip
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=WAIT)
        if stream:  # (its head already sent: the error is the stream's last event)
            assert r.status_code == 200, r.text
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all('"text"' not in e for e in events)
            error = json.loads(events[-2])["error"]
        else:
            assert r.status_code == 400, r.text
            error = r.json()["error"]
        assert error["param"] == "response_format", error
        assert "allowed_token_ids" in error["message"] and "no token is allowed" in error["message"]
        settle(s)
