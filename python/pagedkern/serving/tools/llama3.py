"""Llama 3.1 / 3.2 / 3.3 JSON calls (their templates ask for "a JSON for a function call ...
in the format {"name": function name, "parameters": dictionary of argument name and its
value}"), the whole answer, optionally after `<|python_tag|>` (a special token: the detokenizer
usually drops it) and several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

An answer that opens with `{` but is not such a call is content; text after the calls is
content too."""

from __future__ import annotations

from .base import NotCalls, ToolCall, ToolParser, call_from, next_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    starts_at_beginning = (PYTHON_TAG, "{")
    arguments_key = "parameters"

    def take_calls(self, section: str, start: int, final: bool) -> tuple[list[ToolCall], int]:
        i = start
        if self._calls:  # after a call: only `;` continues
            i = _skip(section, i, " \t\r\n")
            if i == len(section):
                return [], start
            if not section.startswith(";", i):
                raise NotCalls("only `;` may follow a call")  # the rest is content
            i += 1
        decoded = next_json(section, i, final, "call")
        if decoded is None:
            return [], start
        obj, end = decoded
        if not isinstance(obj, dict) or ("parameters" not in obj and "arguments" not in obj):
            raise NotCalls("not a call")
        return [call_from(obj, "parameters")], end

    @staticmethod
    def calls_grammar(call: str, parallel: bool, literal=None) -> str:  # (no tags)
        return f'calls: {call} ("; " {call})*' if parallel else f"calls: {call}"


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i
