"""Tool calling through the HTTP server with the official openai client, on the tiny synthetic
model (random weights; its ChatML template knows no tools, so the generic format applies):
tool_choice "required" and a named function are enforced by the grammar (the call parses and
its arguments validate against the schema, whatever the weights), a two-turn loop sends the
result back, `auto` and `none` return what does not parse as content, parallel_tool_calls
bounds the calls, a stream's deltas add up to the non-streamed answer, and bad tools are 400s
naming the field. One server for the module."""

from __future__ import annotations

import json

import httpx
import pytest
from http_stack import openai
from support.serving import ServerThread
from test_http_server import TINY, tiny_engine

from pagedkern.serving.http.settings import ServerSettings
from pagedkern.serving.tools import tool_parser_for_template

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "today's weather",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(max_tools=8, max_tools_bytes=4096)
    with ServerThread(tiny_engine(), settings=settings) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def create(client, **kwargs):
    body = {"model": TINY, "messages": ASK, "max_tokens": MAX_TOKENS, "seed": 3, **kwargs}
    return client.chat.completions.create(**body)


def checked_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each one's arguments validated against its tool's schema."""
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_tool_loop_two_turns(client):
    first = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [(name, args)] = checked_calls(choice.message)
    call = choice.message.tool_calls[0]
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),  # as agent loops send it back
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})},
    ]
    second = create(client, messages=history, tools=TOOLS, max_tokens=12)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str) and answer.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the result went in


def test_named_function(client):
    for seed in (1, 2):
        r = create(client, tools=TOOLS, seed=seed, tool_choice={
            "type": "function", "function": {"name": "get_time"},
        })  # fmt: skip
        calls = checked_calls(r.choices[0].message)
        assert calls and {name for name, _ in calls} == {"get_time"}


def test_parallel_tool_calls(client):
    """parallel_tool_calls=false: exactly one call; by default the grammar lets the model go
    on to further calls (some seeds of the random model do: seeds 2, 3, 4 of 0..5 today)."""
    most = 0
    for seed in range(2, 10):
        one = create(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
        )
        assert len(checked_calls(one.choices[0].message)) == 1
        many = create(client, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=200)
        assert many.choices[0].finish_reason == "tool_calls"
        calls = many.choices[0].message.tool_calls
        assert len({c.id for c in calls}) == len(checked_calls(many.choices[0].message))
        most = max(most, len(calls))
        if most > 1:
            break
    assert most > 1


def brace_bias(server) -> dict[str, int]:
    """logit_bias making the answer open with `{` (then the random model writes anything)."""
    [brace] = server.engine_loop.tokenizer.encode("{")
    return {str(brace): 100}


def test_auto_returns_what_is_not_a_call_as_content(client, server):
    r = create(client, tools=TOOLS, max_tokens=12)  # auto: the model chose text
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)
    # an answer that starts like a JSON call but is not one: content, never a 500
    r = create(client, tools=TOOLS, max_tokens=12, logit_bias=brace_bias(server))
    message = r.choices[0].message
    assert message.tool_calls is None and message.content.startswith("{")


def test_tool_choice_none_with_tools(client, server):
    r = create(
        client, tools=TOOLS, tool_choice="none", max_tokens=12, logit_bias=brace_bias(server)
    )
    message = r.choices[0].message
    assert message.tool_calls is None and message.content.startswith("{")
    assert r.choices[0].finish_reason in ("stop", "length")


def accumulate(stream) -> tuple[str | None, list[dict], str | None, list[dict]]:
    """(content, tool calls, finish_reason, every tool-call delta) from a stream's chunks."""
    content, calls, finish, deltas = None, {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            deltas.append(d.model_dump(exclude_none=True))
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert entry["id"] is None  # id and name come once
                entry["id"] = d.id
            if d.function and d.function.name is not None:
                assert entry["name"] is None
                entry["name"] = d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, deltas


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tool_choice": "auto", "max_tokens": 12},
    ],
)
def test_stream_equals_the_whole_answer(client, extra):
    whole = create(client, tools=TOOLS, **extra)
    content, calls, finish, deltas = accumulate(create(client, tools=TOOLS, stream=True, **extra))
    message = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason
    assert content == message.content
    expected = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls)
    if calls:  # OpenAI's shape: index, id, type and name first, then the arguments
        assert deltas[0]["type"] == "function" and deltas[0]["function"] == {
            "name": calls[0]["name"], "arguments": ""
        }  # fmt: skip
        assert set(deltas[1]) == {"index", "function"}


def post(server, **body) -> httpx.Response:
    body = {"model": TINY, "messages": ASK, "max_tokens": 4, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def tool_message(call_id):
    return {"role": "tool", "tool_call_id": call_id, "content": "21"}


ISSUED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
]}  # fmt: skip


def fn(**function) -> list[dict]:
    return [{"type": "function", "function": function}]


UNRESOLVED = {"type": "object", "properties": {"a": {"$ref": "#/$defs/no"}}, "required": ["a"]}
LONG = fn(name="f", description="x" * 5000)
NAMED_X = {"type": "function", "function": {"name": "x"}}
JSON = {"type": "json_object"}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": fn(parameters=WEATHER)}, "tools[0].function.name"),
        ({"tools": fn(name="f", parameters={"type": 3})}, "tools[0].function.parameters.type"),
        ({"tools": TOOLS, "tool_choice": NAMED_X}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [*ASK, {"role": "tool", "content": "2"}]}, "messages[1].tool_call_id"),
        ({"messages": [*ASK, ISSUED, tool_message("call_2")]}, "messages[2].tool_call_id"),
        ({"messages": [*ASK, {"role": "assistant"}]}, "messages[1].content"),
        ({"tools": TOOLS * 5}, "tools"),  # over max_tools (8)
        ({"tools": LONG}, "tools"),  # over max_tools_bytes (4096)
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": JSON}, "response_format"),
        ({"response_format": {"type": "grammar", "grammar": 'start: "a"'}}, "response_format"),
        # a schema only the grammar engine refuses (when the forced call's grammar compiles)
        ({"tools": fn(name="f", parameters=UNRESOLVED), "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_tool_requests_name_the_field(server, body, param):
    r = post(server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_tool_result_for_an_issued_call_is_accepted(server):
    r = post(server, tools=TOOLS, messages=[*ASK, ISSUED, tool_message("call_1")])
    assert r.status_code == 200, r.text
    assert post(server, chat_template_kwargs={"greeting": "hi"}).status_code == 200


def test_completions_refuse_tools(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": TINY, "prompt": "x", "tools": TOOLS},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_n_choices_and_logprobs_with_tools(client):
    kwargs = dict(
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2, logprobs=True
    )
    whole = create(client, **kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and len(checked_calls(choice.message)) == 1
    assert sum(len(c.logprobs.content) for c in whole.choices) == whole.usage.completion_tokens
    calls: dict[int, list[str]] = {0: [], 1: []}
    entries = 0
    stream = create(client, stream=True, stream_options={"include_usage": True}, **kwargs)
    for chunk in stream:
        if chunk.usage is not None:
            assert entries == chunk.usage.completion_tokens  # every token's logprob, once
        for choice in chunk.choices:
            entries += len(choice.logprobs.content) if choice.logprobs else 0
            for d in choice.delta.tool_calls or []:
                if d.function.name:
                    calls[choice.index].append(d.function.name)
    assert all(len(names) == 1 for names in calls.values())


# Qwen2.5's chat template, shortened: tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> in a user turn (the parts the HF convention feeds).
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def qwen_client():
    engine = tiny_engine()
    engine.tokenizer.chat_template = QWEN_TEMPLATE
    with ServerThread(engine) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)


def test_a_template_with_tools_renders_them_and_its_family_parses(qwen_client):
    assert tool_parser_for_template(QWEN_TEMPLATE) == "hermes"  # <tool_call> markup, forced
    first = create(qwen_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    [(name, args)] = checked_calls(first.choices[0].message)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"},
    ]
    second = create(qwen_client, messages=history, tools=TOOLS, max_tokens=8)
    plain = create(qwen_client, messages=ASK, max_tokens=8)
    # the tools, the call and the result are in the prompt (the template's own rendering)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens > plain.usage.prompt_tokens
    content, calls, finish, _ = accumulate(
        create(qwen_client, tools=TOOLS, tool_choice="required", stream=True)
    )
    whole = create(qwen_client, tools=TOOLS, tool_choice="required")
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    expected = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert [(c["name"], c["arguments"]) for c in calls] == expected and content is None


def test_forced_tools_whose_grammar_passes_the_size_bound_are_a_400_naming_tools():
    """Tools within max_tools and max_tools_bytes whose forced-call grammar passes the
    grammar's size bound (before: a 500 from the bound's ValueError)."""
    enum = ["x" * 1000 + str(i) for i in range(101)]
    parameters = {"type": "object", "properties": {"a": {"enum": enum}}, "required": ["a"]}
    with ServerThread(tiny_engine()) as s:
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            r = post(s, tools=fn(name="f", parameters=parameters), tool_choice=choice)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "tools" and "forced call" in error["message"]
        assert post(s).status_code == 200
