"""A request's tools before generation: the checks that name the bad field (spec.py), the
generic prompt for templates without tools (prompting.py), and the grammars that force
tool_choice "required" / a named function (grammar.py), run through llguidance on a byte-level
tokenizer: each accepts its family's well-formed calls, arguments valid against the schema,
and refuses a wrong name, invalid arguments, a second call without parallel_tool_calls."""

from __future__ import annotations

import functools
import json

import llguidance
import pytest

from pagedkern.model import synthetic_tokenizer
from pagedkern.serving.tools import TOOL_PARSERS
from pagedkern.serving.tools.grammar import after_thinking, tool_call_grammar
from pagedkern.serving.tools.prompting import template_inputs
from pagedkern.serving.tools.reasoning import Qwen3ReasoningParser, ThinkingGrammar
from pagedkern.serving.tools.spec import (
    ToolChoice,
    ToolSpecError,
    check_history,
    check_tool_choice,
    check_tools,
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "clock", "description": "the time"}},
]
VOCAB = 512


def tool(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "tools,param",
    [
        ({"weather": 1}, "tools"),
        ([tool(description="no name")], "tools[0].function.name"),
        ([tool(name="has space")], "tools[0].function.name"),
        ([tool(name="a"), tool(name="a")], "tools[1].function.name"),
        ([tool(name="a", parameters=[])], "tools[0].function.parameters"),
        ([tool(name="a", parameters={"type": "objekt"})], "tools[0].function.parameters.type"),
        ([tool(name="a", parameters={"type": "string"})], "tools[0].function.parameters.type"),
        (
            [tool(name="a", parameters={"properties": {"x": {"type": "str"}}})],
            "tools[0].function.parameters.properties.x.type",
        ),
        ([tool(name="a", parameters={"required": "x"})], "tools[0].function.parameters.required"),
        ([{"type": "retrieval"}], "tools[0]"),
        ([tool(name=f"t{i}") for i in range(5)], "tools"),  # over max_tools=4
        ([tool(name="a", description="x" * 600)], "tools"),  # over max_bytes=512
    ],
)
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(ToolSpecError) as caught:
        check_tools(tools, max_tools=4, max_bytes=512)
    assert caught.value.param == param


def test_tool_choice():
    functions = check_tools(TOOLS, 8, 10_000)
    assert [f.name for f in functions] == ["weather", "clock"]
    assert functions[1].parameters == {"type": "object", "properties": {}}
    assert check_tool_choice(None, functions) == ToolChoice("auto")
    assert check_tool_choice(None, []) == ToolChoice("none")
    named = {"type": "function", "function": {"name": "clock"}}
    assert check_tool_choice(named, functions) == ToolChoice("named", "clock")
    assert check_tool_choice("required", functions).forced
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"x": 1}):
        with pytest.raises(ToolSpecError, match="tool_choice"):
            check_tool_choice(bad, functions)
    with pytest.raises(ToolSpecError, match="needs tools"):
        check_tool_choice("required", [])


def call(call_id: str, name: str = "weather", arguments: str = '{"city": "Oslo"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_history_checks_every_tool_answer():
    user = {"role": "user", "content": "hi"}
    asked = {"role": "assistant", "content": None, "tool_calls": [call("c1")]}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    checked = check_history([user, asked, answer])
    assert checked[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert checked[2]["name"] == "weather"
    cases = [
        (
            [user, {"role": "tool", "tool_call_id": None, "content": "x"}],
            "messages[1].tool_call_id",
        ),
        ([user, asked, {**answer, "tool_call_id": "c2"}], "messages[2].tool_call_id"),
        ([user, {**answer}], "messages[1].tool_call_id"),  # answers nothing issued before
        ([user, {**asked, "tool_calls": [call("")]}], "messages[1].tool_calls[0].id"),
        (
            [user, {**asked, "tool_calls": [call("c1", arguments="{oops")]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (  # nested past Python's recursion limit (before: RecursionError, a 500)
            [user, {**asked, "tool_calls": [call("c1", arguments="[" * 3000 + "]" * 3000)]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
    ]
    for messages, param in cases:
        with pytest.raises(ToolSpecError) as caught:
            check_history(messages)
        assert caught.value.param == param


def test_generic_prompt_for_a_template_without_tools():
    tok = synthetic_tokenizer(VOCAB)
    functions = check_tools(TOOLS, 8, 10_000)
    history = check_history(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        ]
    )
    messages, tools = template_inputs(history, functions, ToolChoice("required"), False, False)
    assert tools is None and [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    system = messages[0]["content"]
    assert system.startswith("Be brief.") and '"name": "weather"' in system
    assert '{"tool_calls": [{"name": "<tool name>"' in system and "must call" in system
    assert "at most one tool" in system
    assert json.loads(messages[2]["content"]) == {
        "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}] * 2
    }
    results = [json.loads(line)["tool_response"] for line in messages[3]["content"].split("\n")]
    assert [(r["id"], r["name"], r["content"]) for r in results] == [
        ("c1", "weather", "sunny"), ("c2", "weather", "rain"),
    ]  # fmt: skip
    text = tok.apply_chat_template(messages)  # the ChatML template renders it
    assert text.count("<|im_start|>") == 5 and "tool_response" in text
    # a template that renders tools gets them and the history as they are (HF convention)
    messages, tools = template_inputs(history, functions, ToolChoice("auto"), True, True)
    assert tools == [f.as_tool() for f in functions] and messages[3]["role"] == "tool"
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@functools.cache
def byte_level() -> tuple:
    tok = synthetic_tokenizer(VOCAB)
    return tok, llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=VOCAB, eos_token=[2])


def accepts(grammar: dict, text: str) -> bool:
    """Whether `text` is a complete answer of the grammar (byte-level tokens)."""
    tok, llt = byte_level()
    matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar["grammar"]))
    assert not matcher.is_error(), matcher.get_error()
    ok = all(matcher.consume_token(t) for t in tok.encode(text))
    return ok and matcher.is_accepting()


WRITE = {  # one family's call text (compact JSON, as the grammar has it)
    "hermes": lambda calls: "\n".join(
        f"<tool_call>\n{json.dumps(c, separators=(',', ':'))}\n</tool_call>" for c in calls
    ),
    "llama3_json": lambda calls: "; ".join(
        json.dumps({"name": c["name"], "parameters": c["arguments"]}, separators=(",", ":"))
        for c in calls
    ),
    "mistral": lambda calls: json.dumps(calls, separators=(",", ":")),
    "generic": lambda calls: json.dumps({"tool_calls": calls}, separators=(",", ":")),
}


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
def test_forced_call_grammars_allow_only_valid_calls(family):
    parser = TOOL_PARSERS[family]
    functions = check_tools(TOOLS, 8, 10_000)
    good = {"name": "weather", "arguments": {"city": "Oslo", "days": 2}}
    clock = {"name": "clock", "arguments": {}}
    required = tool_call_grammar(parser, functions, ToolChoice("required"), parallel=False)
    write = WRITE[family]
    assert accepts(required, write([good])) and accepts(required, write([clock]))
    assert not accepts(required, write([good, clock]))  # one call without parallel
    assert not accepts(required, write([{**good, "name": "nope"}]))
    assert not accepts(required, write([{**good, "arguments": {"city": 5}}]))
    assert not accepts(required, write([{**good, "arguments": {"days": 2}}]))
    assert not accepts(required, write([{**good, "arguments": {"city": "x", "days": 0}}]))
    assert not accepts(required, "The weather is fine.")
    parallel = tool_call_grammar(parser, functions, ToolChoice("required"), parallel=True)
    assert accepts(parallel, write([good, clock, good]))
    named = tool_call_grammar(parser, functions, ToolChoice("named", "clock"), parallel=False)
    assert accepts(named, write([clock])) and not accepts(named, write([good]))
    # what the grammar lets through, the family's parser reads back
    parsed = parser().parse(write([good, clock]))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("weather", good["arguments"]), ("clock", {})
    ]  # fmt: skip


QWEN3_TEXT = ThinkingGrammar(Qwen3ReasoningParser)  # <think> tags spelled as text


def test_grammars_apply_after_the_thinking():
    functions = check_tools(TOOLS, 8, 10_000)
    forced = tool_call_grammar(
        TOOL_PARSERS["hermes"], functions, ToolChoice("required"), False, QWEN3_TEXT
    )
    answer = '<tool_call>\n{"name":"clock","arguments":{}}\n</tool_call>'
    assert accepts(forced, answer)
    assert accepts(forced, "<think>\nanything {at all} here\n</think>\n\n" + answer)
    assert not accepts(forced, "<think>a</think> b </think>" + answer)  # one thinking only
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = after_thinking({"type": "json_schema", "schema": schema}, QWEN3_TEXT)
    assert accepts(fmt, '<think>hmm, true?</think>\n{"ok":true}') and accepts(fmt, '{"ok":false}')
    assert not accepts(fmt, '<think>hmm</think>{"ok":1}')


def test_a_tag_that_is_one_token_is_matched_by_text_and_by_its_id():
    """Qwen's <tool_call> is an added token; llguidance treats it as special, so the forced
    grammar names its id too (a text literal alone would let the mask offer the token and
    then refuse it)."""
    from tokenizers import AddedToken

    tok = synthetic_tokenizer(VOCAB - 2)
    tags = [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")]
    tok.backend.add_tokens(tags)
    llt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=VOCAB, eos_token=[2])
    functions = check_tools(TOOLS, 8, 10_000)
    grammar = tool_call_grammar(
        TOOL_PARSERS["hermes"], functions, ToolChoice("required"), False, encode=tok.encode
    )["grammar"]
    text = '<tool_call>\n{"name":"clock","arguments":{}}\n</tool_call>'
    by_token = tok.encode(text)
    assert by_token[0] == VOCAB - 2 and by_token[-1] == VOCAB - 1
    by_text = [i for ch in text for i in tok.backend.encode(ch).ids]  # (no added tokens)
    assert VOCAB - 2 not in by_text
    for ids in (by_token, by_text):
        matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar))
        assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_cli_flags_reach_the_server_settings():
    from pagedkern.serving.cli.args import build_parser
    from pagedkern.serving.cli.config_from_flags import server_settings

    args = build_parser().parse_args(
        ["--http", "--tool-call-parser", "qwen3", "--reasoning-parser", "deepseek_r1",
         "--max-tools", "3", "--max-tools-bytes", "999"]
    )  # fmt: skip
    settings = server_settings(args)
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("qwen3", "deepseek_r1")
    assert (settings.max_tools, settings.max_tools_bytes) == (3, 999)
    defaults = server_settings(build_parser().parse_args(["--http"]))
    assert defaults.tool_call_parser is None and defaults.reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--http", "--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        type(settings)(reasoning_parser="nope")


def test_forced_arguments_hold_the_declared_properties_only():
    """A schema that leaves additionalProperties unset is closed for the grammar (a small model
    otherwise invents properties until max_tokens); one that allows them keeps them."""
    open_schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    for allowed in (None, True):
        schema = open_schema if allowed is None else {**open_schema, "additionalProperties": True}
        functions = check_tools([tool(name="w", parameters=schema)], 8, 10_000)
        grammar = tool_call_grammar(
            TOOL_PARSERS["generic"], functions, ToolChoice("required"), parallel=False
        )
        extra = '{"tool_calls":[{"name":"w","arguments":{"city":"Oslo","x":1}}]}'
        assert accepts(grammar, '{"tool_calls":[{"name":"w","arguments":{"city":"Oslo"}}]}')
        assert accepts(grammar, extra) == bool(allowed)


@pytest.mark.parametrize("parameters", [{}, {"properties": {"city": {"type": "string"}}}])
def test_forced_arguments_are_an_object_whatever_the_parameters_say(parameters):
    """parameters {} (any JSON) or without a type: the forced call's arguments are still an
    object (before: a number or a list passed the grammar, and the answer came back as
    content, no call, from a forced tool_choice)."""
    functions = check_tools([tool(name="w", parameters=parameters)], 8, 10_000)
    grammar = tool_call_grammar(
        TOOL_PARSERS["generic"], functions, ToolChoice("required"), parallel=False
    )
    assert accepts(grammar, '{"tool_calls":[{"name":"w","arguments":{}}]}')
    for arguments in ("5765671554", "[1]", '"x"', "null"):
        assert not accepts(grammar, f'{{"tool_calls":[{{"name":"w","arguments":{arguments}}}]}}')
