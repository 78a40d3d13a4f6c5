"""Hermes-style calls, as Qwen2.5 and Qwen3 write them (their chat templates describe tools
in `<tools>` and ask for this):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ...}
    </tool_call>

Content may come before the first call. A last call cut by EOS before its `</tool_call>`
still counts (the JSON is complete)."""

from __future__ import annotations

from collections.abc import Callable

from .base import NotCalls, ToolCall, ToolParser, call_from, decode_json_prefix, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    starts = (OPEN,)

    def take_calls(self, section: str, final: bool) -> tuple[list[ToolCall], int]:
        calls: list[ToolCall] = []
        used = 0
        while True:
            i = _skip_space(section, used)
            if calls or self._calls:  # after a call: only another <tool_call> continues
                if section.startswith(OPEN, i):
                    i += len(OPEN)
                else:
                    return calls, used
            decoded = decode_json_prefix(section, i)
            if decoded is None:
                if final:
                    raise NotCalls("an unfinished call")
                return calls, used
            obj, end = decoded
            j = _skip_space(section, end)
            if section.startswith(CLOSE, j):
                end = j + len(CLOSE)
            elif not final and partial_suffix(section[j:], (CLOSE,)) == len(section) - j:
                return calls, used  # the closing tag may be coming
            elif j < len(section):
                raise NotCalls(f"{CLOSE} expected")
            calls.append(call_from(obj))
            used = end
            if final and not section[used:].strip():
                return calls, len(section)

    @staticmethod
    def calls_grammar(call: str, parallel: bool, literal: Callable[[str], str]) -> str:
        """Lark rule `calls` for forced calls: `call` is the rule of one call's JSON,
        literal(text) a tag's expression (grammar.literal)."""
        one = f'{literal(OPEN)} "\\n" {call} "\\n" {literal(CLOSE)}'
        return f'calls: {one} ("\\n" {one})*' if parallel else f"calls: {one}"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
