"""Reasoning output: `<think>...</think>` moved into reasoning_content.

The parsers over each family's answers, cut anywhere; then through the HTTP server with a
tokenizer that carries `<think>` / `</think>` as tokens and a template whose generation prompt
opens the thinking (DeepSeek-R1's kind), on the tiny random model: logit_bias on `</think>`
ends the thinking after a few random tokens, and the grammar puts structured output and forced
tool calls after it."""

from __future__ import annotations

import json

import pytest

from pagedkern.serving.tools import reasoning_parser_for_template, tool_parser_named
from pagedkern.serving.tools.output import ChatOutputParser
from pagedkern.serving.tools.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

# (parser, answer, reasoning, content)
CASES = [
    (
        Qwen3ReasoningParser,
        "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.",
        "\nThe user asks 2+2. That is 4.\n",
        "The answer is 4.",
    ),
    (Qwen3ReasoningParser, "The answer is 4 <think> maybe.", "", "The answer is 4 <think> maybe."),
    (Qwen3ReasoningParser, "<think>still going", "still going", ""),
    (Qwen3ReasoningParser, "  <thin", "", "  <thin"),
    (DeepSeekR1ReasoningParser, "Okay, 2+2=4.\n</think>\n\n**4**", "Okay, 2+2=4.\n", "**4**"),
    (DeepSeekR1ReasoningParser, "<think>x</think>y </think>", "x", "y </think>"),
    (DeepSeekR1ReasoningParser, "no end of thinking", "no end of thinking", ""),
]


def run(parser, pieces):
    p, reasoning, content = parser(), "", ""
    for piece in pieces:
        out = p.feed(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = p.finish()
    return reasoning + out.reasoning, content + out.content


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_reasoning_split_cut_anywhere(parser, text, reasoning, content):
    for k in range(len(text) + 1):
        assert run(parser, [text[:k], text[k:]]) == (reasoning, content), k
    assert run(parser, list(text)) == (reasoning, content)


def test_thinking_then_tool_calls():
    text = (
        "<think>I could write <tool_call> here, it is only thinking.</think>\n"
        'Checking.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    for k in range(len(text) + 1):
        p = ChatOutputParser(Qwen3ReasoningParser, tool_parser_named("hermes"))
        out = p.feed(text[:k])
        out += p.feed(text[k:])
        out += p.finish()
        assert out.reasoning == "I could write <tool_call> here, it is only thinking."
        assert out.content == "Checking."
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"a": 1})]


def test_family_by_template():
    qwen3 = (
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is "
        "defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
        "{{ '<think>' in m }}"
    )
    r1 = "{{ '<think>' }}...{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
    assert reasoning_parser_for_template(qwen3) == "qwen3"
    assert reasoning_parser_for_template(r1) == "deepseek_r1"
    assert reasoning_parser_for_template("{{ messages }}") is None


# --- through the server ----------------------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def thinking_server():
    pytest.importorskip("http_stack")
    from support.serving import ServerThread
    from test_http_server import tiny_engine
    from tokenizers import AddedToken

    from pagedkern.engine import Engine
    from pagedkern.model import synthetic_tokenizer
    from pagedkern.serving.http.settings import ServerSettings

    base = tiny_engine()
    vocab = base.vocab_size
    tokenizer = synthetic_tokenizer(vocab - 2)  # <think>, </think>: the last two ids
    tags = [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    tokenizer.backend.add_tokens(tags)
    tokenizer.chat_template = THINKING_TEMPLATE
    engine = Engine(base.model, tokenizer, base.config)
    settings = ServerSettings(reasoning_parser="deepseek_r1")
    with ServerThread(engine, settings=settings) as server:
        yield server, tokenizer.encode("</think>")[0]


def close_soon(end_think: int) -> dict:
    return {str(end_think): 6.0}  # </think> a few random tokens in


@pytest.fixture(scope="module")
def thinking_client(thinking_server):
    from http_stack import openai

    server, _ = thinking_server
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def chat(client, **kwargs):
    body = {"model": "synthetic:tiny", "messages": ASK, "max_tokens": 64, "seed": 11}
    return client.chat.completions.create(**{**body, **kwargs})


def streamed(stream) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


SEEDS = (11, 12, 13)  # random weights: some answers run out of tokens while thinking


def test_structured_output_comes_after_the_thinking(thinking_server, thinking_client):
    jsonschema = pytest.importorskip("jsonschema")
    _, end_think = thinking_server
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    thought = 0
    for seed in SEEDS:
        kwargs = dict(response_format=fmt, logit_bias=close_soon(end_think), seed=seed)
        whole = chat(thinking_client, **kwargs)
        message = whole.choices[0].message.model_dump()
        reasoning = message.get("reasoning_content") or ""
        assert "</think>" not in reasoning
        if whole.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(message["content"]), ANSWER)  # the answer only
            thought += bool(reasoning)
        finish = whole.choices[0].finish_reason
        stream = streamed(chat(thinking_client, stream=True, **kwargs))
        assert stream == (reasoning, message["content"], finish)
    assert thought  # at least one answer thought first, then answered in the schema


def test_forced_tool_call_after_the_thinking(thinking_server, thinking_client):
    _, end_think = thinking_server
    tools = [{"type": "function", "function": {"name": "add", "parameters": ANSWER}}]
    thought = 0
    for seed in SEEDS:
        r = chat(
            thinking_client, tools=tools, tool_choice="required", parallel_tool_calls=False,
            logit_bias=close_soon(end_think), seed=seed,
        )  # fmt: skip
        message = r.choices[0].message.model_dump()
        if r.choices[0].finish_reason == "length":
            continue
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "add"
        assert 0 <= json.loads(call["function"]["arguments"])["answer"] <= 9
        thought += bool(message.get("reasoning_content"))
    assert thought


def test_chat_template_kwargs_reach_the_template(thinking_client):
    on = chat(thinking_client, max_tokens=4)
    off = chat(thinking_client, max_tokens=4, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}
    })  # fmt: skip
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the closed <think></think>
    # the template closed the thinking: the whole answer is content
    assert off.choices[0].message.model_dump().get("reasoning_content") is None
    assert on.choices[0].message.content in (None, "")  # 4 tokens: still thinking
