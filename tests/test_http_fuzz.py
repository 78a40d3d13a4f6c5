"""Schema fuzz of the HTTP API: random JSON within and around the request
schemas (huge numbers, wrong types, nulls, deep nesting, unicode with lone surrogates, extra
fields, raw non-JSON bytes) is answered 2xx or 4xx, never 5xx, a stream never carries a server
error, and the server still serves a normal request afterwards. Bounded for CI: 100 examples
per endpoint on synthetic:tiny with a 32-token context."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.serving import ServerThread

from pagedkern.engine import Engine, EngineConfig

TINY = "synthetic:tiny"
EXAMPLES = 100

EDGE_INTS = [
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    2**64,
    10**30,
]
edge = st.sampled_from(EDGE_INTS)  # the limits of int32 / int64 and past them
ints = st.one_of(edge, st.integers(), st.integers(-3, 600))
floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1e-300, 2.0, 2.0000001, 1e308, -0.0]),
)
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\ud800", "\udfff\ud800", "<|im_end|>", "\x00", "é" * 300]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


plain = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)  # no surrogates
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.one_of(
            plain, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain}))
        ),
    }
)
OPTIONAL = {
    "max_tokens": st.one_of(st.integers(1, 4), edge),
    "max_completion_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.one_of(st.integers(-1, 50), edge),
    "seed": st.one_of(st.integers(0, 2**63 - 1), edge),
    "stop": st.one_of(plain, st.lists(plain, max_size=4)),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, 600), edge), max_size=4),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "logprobs": st.booleans(),
    "presence_penalty": st.just(0.0),
    "logit_bias": st.just({}),
    "user": plain,
    "echo": st.booleans(),
    "suffix": plain,
    "extra_field": anything,
}


@st.composite
def bodies(draw, required: dict) -> dict:
    """A request within the schema (required fields, up to four optional ones), then up to
    three mutations around it: a field dropped, or set to any JSON value at all."""
    body = {name: draw(value) for name, value in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONAL)), unique=True, max_size=4)):
        body[name] = draw(OPTIONAL[name])
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(set(body) | set(OPTIONAL) | set(required))))
        if draw(st.booleans()):
            body.pop(name, None)
        else:
            body[name] = draw(anything)
    return body


chat_bodies = bodies(
    {"model": st.just(TINY), "messages": st.lists(message, min_size=1, max_size=3)}
)
completion_bodies = bodies(
    {
        "model": st.just(TINY),
        "prompt": st.one_of(
            plain,
            st.lists(plain, min_size=1, max_size=1),
            st.lists(st.one_of(st.integers(0, 520), edge), min_size=1, max_size=6),
            st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=4), max_size=1),
        ),
    }
)


def raw(body) -> bytes:
    return json.dumps(body).encode()


RAW_BODIES = [
    b"",
    b"null",
    b"[]",
    b"{",
    b"\xff\xfe",
    b'{"model": NaN}',
    b'{"temperature": Infinity, "model": "synthetic:tiny"}',
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    raw({"model": TINY, "prompt": [[[[[[[[[[1]]]]]]]]]]}),
    raw({"model": TINY, "prompt": [2**64] * 30}),
    raw({"model": TINY, "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}),
    raw({"model": TINY, "messages": [{"role": "user", "content": "hi"}], "top_k": 2**31}),
]


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_config(
        EngineConfig(
            model=TINY,
            backend="reference",
            device="cpu",
            num_blocks=64,
            block_size=4,
            max_model_len=32,
        )
    )

    def check_pool(e: Engine) -> None:
        e.pool.check_invariants(e.scheduler.block_tables())

    with (
        ServerThread(engine, after_step=check_pool) as s,
        httpx.Client(base_url=s.url, timeout=60) as client,
    ):
        s.client = client
        yield s
        ok = client.post(
            "/v1/chat/completions",
            json={"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def check(server, path: str, content: bytes) -> None:
    with server.client.stream(
        "POST", path, content=content, headers={"content-type": "application/json"}
    ) as r:
        body = r.read()
    assert r.status_code < 500, (r.status_code, body[:500], content[:300])
    if r.status_code >= 400:
        error = json.loads(body)["error"]
        assert error["message"] and error["type"] != "server_error", error
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert b'"server_error"' not in body, body[-500:]
        assert body.endswith(b"data: [DONE]\n\n")


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples in every CI run
)


@FUZZ
@given(body=chat_bodies)
def test_chat_schema_fuzz(server, body):
    check(server, "/v1/chat/completions", raw(body))


@FUZZ
@given(body=completion_bodies)
def test_completions_schema_fuzz(server, body):
    check(server, "/v1/completions", raw(body))


@pytest.mark.parametrize("content", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_raw_bodies(server, path, content):
    check(server, path, content)
