"""The sampling surface over HTTP: n choices, logprobs in OpenAI's chat and
completions shapes, several prompts per completion request, /tokenize and /detokenize, and
response_format through the official `openai` client (streamed and not) on the default model,
with every answer parsing and validating against its schema."""

from __future__ import annotations

import json

import httpx
import pytest
from http_stack import openai
from support.serving import ServerThread
from test_http_server import TINY, kv_used, tiny_engine

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.outputs import TokenLogprob
from pagedkern.serving.core.request_stream import StreamOutput
from pagedkern.serving.http.body_formats import ChatFormat, CompletionFormat
from pagedkern.serving.http.request_models import IMPLEMENTED, UNSUPPORTED

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def server():
    with ServerThread(tiny_engine()) as s:
        yield s


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_the_field_lists_are_disjoint():
    assert not set(IMPLEMENTED) & set(UNSUPPORTED)


def test_n_choices_with_chat_logprobs(server):
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "n": 3,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 2,
        "an_unknown_field": {"ignored": True},
        "ignore_eos": True,
    }
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 12
    for choice in data["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            assert tops == sorted(tops, reverse=True) and entry["logprob"] <= tops[0] + 1e-6
    assert kv_used(server) == 0


def test_completions_prompts_times_n_and_logprob_shape(server):
    body = {
        "model": TINY,
        "prompt": [[5, 6, 7], [8, 9, 10, 11]],
        "max_tokens": 3,
        "n": 2,
        "logprobs": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"]  # greedy: the n samples agree
    lp = choices[2]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    # streamed: every choice index appears and each ends with a finish reason
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1, 2, 3}
    texts = post(server, "/v1/completions", {**body, "prompt": ["one", "two"], "n": 1}).json()
    assert [c["index"] for c in texts["choices"]] == [0, 1]
    assert kv_used(server) == 0


def test_completions_echo_with_logprobs_gives_prompt_logprobs(server):
    # OpenAI's shape: the prompt's tokens, then the generated ones; None for the first prompt
    # token; values from the raw model (the engine's prompt_logprobs, checked against a full
    # forward in test_logits_engine.py), text_offset into the echoed text.
    prompt = [5, 60, 7, 300, 9]
    body = {"model": TINY, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}
    body |= {"logprobs": 2, "ignore_eos": True, "n": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    plain = post(server, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    engine = Engine.from_config(EngineConfig(model=TINY, backend="reference", block_size=4))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    engine.add_request(prompt_ids=prompt, params=params)
    finals = []
    while engine.has_unfinished:
        finals += [o for o in engine.step() if o.finished]
    table = finals[0].prompt_logprobs
    tokenizer = engine.tokenizer
    echoed = tokenizer.decode(prompt)
    for choice in choices:
        lp = choice["logprobs"]
        assert choice["text"] == echoed + plain["text"]
        n = len(prompt) + 3
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["tokens"][: len(prompt)] == [tokenizer.decode([t]) for t in prompt]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][p] - table[p].logprob) < 1e-6
            assert 1 <= len(lp["top_logprobs"][p]) <= 2  # keyed by text: byte tokens collide
        generated = lp["token_logprobs"][len(prompt) :]
        assert generated == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert offsets[len(prompt)] == len(echoed)
    assert kv_used(server) == 0


def test_alternatives_that_decode_alike_keep_the_likeliest_logprob():
    # ids 1 and 2 both show as "\ufffd" (two byte pieces of one character): completions' map
    # has one key for them, which must hold the likelier one's logprob, not the last one's
    texts = {1: "\ufffd", 2: "\ufffd", 3: "a"}
    lp = TokenLogprob(3, -0.1, top=((3, -0.1), (1, -1.5), (2, -2.5)))
    out = StreamOutput(text="a", token_ids=[3], finished=False, finish_reason=None, logprobs=(lp,))
    body = CompletionFormat("c", "m", False, texts.__getitem__).logprobs(0, out)
    assert body["top_logprobs"] == [{"a": -0.1, "\ufffd": -1.5}]
    by_id = CompletionFormat("c", "m", False, texts.__getitem__, tokens_as_ids=True)
    body = by_id.logprobs(0, out)
    assert body["tokens"] == ["token_id:3"] and body["text_offset"] == [0]
    assert body["top_logprobs"] == [{"token_id:3": -0.1, "token_id:1": -1.5, "token_id:2": -2.5}]
    assert by_id.logprobs(0, out)["text_offset"] == [1]  # the text's length, not the name's
    chat = ChatFormat("c", "m", False, texts.__getitem__, tokens_as_ids=True).logprobs(0, out)
    entry = chat["content"][0]
    assert entry["token"] == "token_id:3" and entry["bytes"] == [97]
    assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:3", "token_id:1", "token_id:2"]
    assert entry["top_logprobs"][1]["bytes"] == list("\ufffd".encode())


def test_return_tokens_as_token_ids_over_http(server):
    prompt = [5, 60, 7, 300, 9]
    body = {"model": TINY, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}
    body |= {"logprobs": 3, "ignore_eos": True}
    by_text = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    r = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][: len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(len(top) == 3 for top in lp["top_logprobs"][1:])  # ids never collide
    assert lp["text_offset"] == by_text["text_offset"]
    assert lp["token_logprobs"] == by_text["token_logprobs"]
    chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    chat |= {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(c["token"].startswith("token_id:") for c in content)
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"model": TINY, "prompt": "hello world"})
    assert r.status_code == 200
    data = r.json()
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] > 0
    back = post(server, "/detokenize", {"model": TINY, "tokens": data["tokens"]}).json()
    assert "hello world" in back["prompt"]
    chat = post(
        server, "/tokenize", {"model": TINY, "messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] > data["count"] - 2
    assert post(server, "/detokenize", {"model": TINY, "tokens": [10**6]}).status_code == 400
    assert post(server, "/tokenize", {"model": TINY}).status_code == 400
    assert post(server, "/tokenize", {"model": TINY, "prompt": "x"}).status_code == 200


def test_tokenize_checks_messages_as_chat_does(server):
    """/tokenize refuses the messages the chat route refuses, with its error, and counts the
    prompt the chat route makes of those it takes (a tool call and its result included)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    refused = [
        [],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": "hi"}, {**history[1], "tool_calls": [{"bogus": 1}]}],
    ]
    for messages in refused:
        chat = post(server, "/v1/chat/completions", {"model": TINY, "messages": messages})
        counted = post(server, "/tokenize", {"model": TINY, "messages": messages})
        assert chat.status_code == counted.status_code == 400, counted.text
        assert counted.json()["error"] == chat.json()["error"]
    counted = post(server, "/tokenize", {"model": TINY, "messages": history})
    chat = post(
        server, "/v1/chat/completions", {"model": TINY, "messages": history, "max_tokens": 1}
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_server():
    engine = Engine.from_config(EngineConfig(backend="reference", kv_cache_gib=0.25))
    with ServerThread(engine) as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_response_format(default_server, stream):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="-")
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "Name a city as JSON."}]
    kwargs = dict(
        model=default_server.model_name,
        messages=messages,
        max_tokens=40,
        temperature=0.7,
        seed=3,
        response_format=fmt,
    )
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        answer = client.chat.completions.create(**kwargs)
        text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    cut = client.chat.completions.create(**{**kwargs, "max_tokens": 2})
    assert cut.choices[0].finish_reason == "length"
    obj = client.chat.completions.create(
        **{**kwargs, "response_format": {"type": "json_object"}, "max_tokens": 60}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
