"""Tool-call parsers, one family at a time, over answers written in each family's documented
format: the calls and the content come out, a stream cut anywhere (every character boundary,
and one character at a time) yields exactly what the whole answer does with no markup in the
content, and malformed calls come back as plain content. Then the request checks (spec.py),
the generic prompt (prompting.py) and the forced-call grammars (grammar.py) run through
llguidance: they accept the family's calls and nothing else."""

from __future__ import annotations

import json

import pytest

from pagedkern.serving.tools import (
    TOOL_PARSERS,
    template_handles_tools,
    tool_parser_for_template,
    tool_parser_named,
)
from pagedkern.serving.tools.base import ToolParser
from pagedkern.serving.tools.generic import GenericJsonToolParser
from pagedkern.serving.tools.hermes import HermesToolParser
from pagedkern.serving.tools.llama3 import Llama3JsonToolParser
from pagedkern.serving.tools.mistral import MistralToolParser

WEATHER = {"location": "San Francisco, CA, USA", "unit": "celsius"}
DATE = {"location": "Zürich", "date": "2024-10-01"}

# (parser, answer, expected content, expected [(name, arguments)])
CASES = [
    # Qwen2.5's documented answer: two calls, nothing else
    (
        HermesToolParser,
        '<tool_call>\n{"name": "get_current_temperature", "arguments": '
        '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_temperature_date", "arguments": '
        '{"location": "Zürich", "date": "2024-10-01"}}\n</tool_call>',
        "",
        [("get_current_temperature", WEATHER), ("get_temperature_date", DATE)],
    ),
    # content first, then one call whose </tool_call> EOS cut off
    (
        HermesToolParser,
        'Let me check that.\n<tool_call>\n{"name": "f", "arguments": {}}',
        "Let me check that.\n",
        [("f", {})],
    ),
    (HermesToolParser, "No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    # Llama 3.1's documented JSON call
    (
        Llama3JsonToolParser,
        '{"name": "get_current_temperature", "parameters": {"location": "San Francisco, CA, '
        'USA", "unit": "celsius"}}',
        "",
        [("get_current_temperature", WEATHER)],
    ),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "a", "parameters": {"x": [1, {"y": "}"}]}}; '
        '{"name": "b", "parameters": {}}',
        "",
        [("a", {"x": [1, {"y": "}"}]}), ("b", {})],
    ),
    (Llama3JsonToolParser, "It is 20 °C {roughly}.", "It is 20 °C {roughly}.", []),
    # Mistral v0.3 (marker + array), without the marker (a dropped control token), v11 form
    (
        MistralToolParser,
        '[TOOL_CALLS] [{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA", "unit": "celsius"}}]',
        "",
        [("get_current_temperature", WEATHER)],
    ),
    (
        MistralToolParser,
        '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": "[ARGS]"}}]',
        "",
        [("a", {}), ("b", {"k": "[ARGS]"})],
    ),
    (
        MistralToolParser,
        'Sure. [TOOL_CALLS]get_temperature_date[ARGS]{"location": "Zürich", "date": '
        '"2024-10-01"}[TOOL_CALLS]f[ARGS]{}',
        "Sure. ",
        [("get_temperature_date", DATE), ("f", {})],
    ),
    (MistralToolParser, "[1, 2] is a list.", "[1, 2] is a list.", []),
    # the generic format (prompting.py asks for it)
    (
        GenericJsonToolParser,
        '{"tool_calls": [{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA", "unit": "celsius"}}, {"name": "f", "arguments": {}}]}',
        "",
        [("get_current_temperature", WEATHER), ("f", {})],
    ),
    (GenericJsonToolParser, '{"tool_call": {"name": "f", "arguments": "{}"}}', "", [("f", {})]),
    (GenericJsonToolParser, "Hello {there}", "Hello {there}", []),
]

MALFORMED = [
    (HermesToolParser, 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"name": "f", "argu'),  # cut mid-call
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": 1}'),  # unclosed
    (Llama3JsonToolParser, '{"answer": 42}'),  # JSON, not a call
    (MistralToolParser, '[TOOL_CALLS] [{"name": "f", "arguments": {}'),
    (MistralToolParser, "[TOOL_CALLS]f{}"),  # no [ARGS]
    (GenericJsonToolParser, '{"tool_calls": []}'),
    (GenericJsonToolParser, '{"tool_calls": [{"name": "f", "arguments": "{nope"}]}'),
    (GenericJsonToolParser, '{"tool_calls": [{"name": "f"'),
]


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(parser: type[ToolParser], pieces: list[str]):
    """The parser fed `pieces`; (content pieces, calls)."""
    p = parser()
    contents, calls = [], []
    for piece in pieces:
        out = p.feed(piece)
        contents.append(out.content)
        calls += out.calls
    out = p.finish()
    contents.append(out.content)
    return contents, calls + out.calls


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_family_answers_parse(parser, text, content, calls):
    whole = parser().parse(text)
    assert whole.content == content
    assert calls_of(whole) == calls
    assert all(c.id.startswith("call_") for c in whole.calls)
    assert len({c.id for c in whole.calls}) == len(whole.calls)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_a_stream_cut_anywhere_equals_the_whole_answer(parser, text, content, calls):
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        contents, got = streamed(parser, pieces)
        assert "".join(contents) == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, pieces
        if calls:  # no markup ever shown as content
            for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name"', "[{"):
                assert marker not in "".join(contents)


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_malformed_calls_come_back_as_content(parser, text):
    whole = parser().parse(text)
    assert whole.calls == [] and whole.content == text
    for k in range(len(text) + 1):
        contents, calls = streamed(parser, [text[:k], text[k:]])
        assert calls == [] and "".join(contents) == text


DEEP = "[" * 3000 + "]" * 3000  # JSON nested past Python's recursion limit


@pytest.mark.parametrize(
    "parser,text",
    [
        (HermesToolParser, f'<tool_call>\n{{"name": "f", "arguments": {{"a": {DEEP}}}}}\n</tool_call>'),  # noqa: E501
        (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": ' + "[" * 3000),
        (GenericJsonToolParser, f'{{"tool_calls": [{{"name": "f", "arguments": "{DEEP}"}}]}}'),
        (GenericJsonToolParser, '{"tool_calls": [{"name": "f", "arguments": {"a": ' + DEEP),
        (Llama3JsonToolParser, f'{{"name": "f", "parameters": {{"a": {DEEP}}}}}'),
        (MistralToolParser, f"[TOOL_CALLS]f[ARGS]{{\"a\": {DEEP}}}"),
    ],
)  # fmt: skip
def test_calls_nested_past_the_recursion_limit_come_back_as_content(parser, text):
    """A model's answer nesting deeper than Python's json can read (before: RecursionError out
    of the parser, a 500 or a stream cut mid-body) is content, whole or streamed."""
    whole = parser().parse(text)
    assert whole.calls == [] and whole.content == text
    for pieces in ([text], [text[: len(text) // 2], text[len(text) // 2 :]]):
        contents, calls = streamed(parser, pieces)
        assert calls == [] and "".join(contents) == text


@pytest.mark.parametrize(
    "parser,text",
    [
        (
            HermesToolParser,
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone, then.',
        ),
        (Llama3JsonToolParser, '{"name": "f", "parameters": {}} Done, then.'),
        (MistralToolParser, "[TOOL_CALLS]f[ARGS]{}\nDone, then."),
    ],
)
def test_text_after_the_calls_is_kept_as_content(parser, text):
    """(A stream shows each call once it is complete, so what follows cannot take it back.)"""
    whole = parser().parse(text)
    assert calls_of(whole) == [("f", {})] and whole.content == "Done, then."
    for k in range(len(text) + 1):
        contents, calls = streamed(parser, [text[:k], text[k:]])
        assert "".join(contents) == "Done, then." and len(calls) == 1


def test_calls_stream_as_soon_as_each_is_complete():
    first = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
    p = HermesToolParser()
    assert [c.name for c in p.feed(first).calls] == ["a"]
    assert p.feed('<tool_call>\n{"name": "b", ').calls == []
    assert [c.name for c in p.feed('"arguments": {}}\n</tool_call>').calls] == ["b"]
    assert p.finish().calls == []


def test_parsers_by_name_and_by_template():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "generic"}
    assert tool_parser_named("qwen3") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        tool_parser_named("nope")
    qwen = "{% if tools %}<tools>{{ tools }}</tools> ... <tool_call>{% endif %}"
    llama = '{% if tools %}{{ \'<|python_tag|>\' }}{"name", "parameters"}{% endif %}'
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
    chatml = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    assert [tool_parser_for_template(t) for t in (qwen, llama, mistral, chatml, None)] == [
        "hermes", "llama3_json", "mistral", "generic", "generic"
    ]  # fmt: skip
    assert template_handles_tools(qwen) and not template_handles_tools(chatml)
