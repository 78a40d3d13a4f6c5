"""Grammars (llguidance's Lark syntax, run by the engine's structured-output machinery) for
what must not be left to chance:

- tool_choice "required" or a named function: the answer is the family's call markup around
  JSON whose "name" is one of the allowed tools and whose arguments follow that tool's
  schema (`%json{...}`: llguidance's JSON-schema grammar inside the Lark one; objects closed to
  their declared properties unless the schema says otherwise); one call, or several with
  parallel_tool_calls;
- with a reasoning parser, structured output and forced calls apply after the thinking: an
  optional (or, where the prompt opened it, required) `<think>...</think>` comes first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from .base import ToolParser
from .reasoning import ThinkingGrammar
from .spec import Function, ToolChoice

_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def call_schema(function: Function, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            arguments_key: _arguments(function.parameters),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def tool_call_grammar(
    parser: type[ToolParser],
    functions: list[Function],
    choice: ToolChoice,
    parallel: bool,
    thinking: ThinkingGrammar | None = None,
    encode: Callable[[str], list[int]] | None = None,
) -> dict:
    """The response_format ({"type": "grammar", ...}) that forces `choice`'s call(s).
    encode (the tokenizer's): a family tag that is one token is also matched by its id."""
    allowed = [f for f in functions if choice.mode != "named" or f.name == choice.name]
    key = getattr(parser, "arguments_key", "arguments")
    schemas = [call_schema(f, key) for f in allowed]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    calls = parser.calls_grammar("call", parallel, lambda text: literal(text, encode))
    rules = [calls, f"call: %json {_json({**one, **_COMPACT})}"]
    return _with_thinking("calls", rules, thinking)


def _arguments(parameters):
    """A call's arguments schema: the tool's parameters, closed, and always an object (a call's
    arguments are an object: parameters {} or without a type would let a number through)."""
    schema = closed(parameters)
    if schema is True or schema == {}:
        return {"type": "object"}
    if isinstance(schema, Mapping) and "type" not in schema:
        return {**schema, "type": "object"}
    return schema


def closed(schema):
    """`schema` with `additionalProperties: false` on every object that declares properties
    and does not say (as llama.cpp's grammars do): a forced call then holds the declared
    arguments only, still valid against the schema, and a small model cannot wander into
    properties of its own until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _closed_member(key, value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_member(key: str, value):
    if key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
        return {name: closed(sub) for name, sub in value.items()}
    if key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "not"):
        return closed(value)
    return value


def after_thinking(response_format: Mapping | None, thinking: ThinkingGrammar) -> dict:
    """A checked response_format (engine form: {"type", "schema"}) moved after the thinking."""
    if response_format is None or response_format["type"] == "grammar":
        return response_format  # type: ignore[return-value]
    schema = response_format["schema"]
    schema = {**schema, **_COMPACT} if isinstance(schema, Mapping) else schema
    return _with_thinking("answer", [f"answer: %json {_json(schema)}"], thinking)


def _with_thinking(body: str, rules: list[str], thinking: ThinkingGrammar | None) -> dict:
    if thinking is None:
        start = f"start: {body}"
    else:
        use, think = thinking.rules()
        start = f"start: {use} {body}"
        rules = [*rules, *think]
    return {"type": "grammar", "grammar": "\n".join([start, *rules]) + "\n"}


def literal(text: str, encode: Callable[[str], list[int]] | None) -> str:
    """A Lark expression for `text`; where the tokenizer has it as one token (Qwen's
    `<tool_call>`), that token too: llguidance treats such added tokens as special, which a
    text literal does not match."""
    quoted = _json(text)
    ids = encode(text) if encode is not None else []
    return f"({quoted} | <[{ids[0]}]>)" if len(ids) == 1 and len(text) > 1 else quoted


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)
