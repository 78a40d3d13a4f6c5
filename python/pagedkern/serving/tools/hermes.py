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

from .base import NotCalls, ToolCall, ToolParser, call_from, next_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    starts = (OPEN,)

    def take_calls(self, section: str, start: int, final: bool) -> tuple[list[ToolCall], int]:
        i = _skip_space(section, start)
        if self._calls:  # after a call: only another <tool_call> continues
            if i == len(section):
                return [], start
            if not section.startswith(OPEN, i):
                if not final and OPEN.startswith(section[i : i + len(OPEN)]):
                    return [], start  # (the tag may be coming)
                raise NotCalls(f"only {OPEN} may follow a call")  # the rest is content
            i += len(OPEN)
        decoded = next_json(section, i, final, "call")
        if decoded is None:
            return [], start
        obj, end = decoded
        j = _skip_space(section, end)
        if section.startswith(CLOSE, j):
            end = j + len(CLOSE)
        elif not final and CLOSE.startswith(section[j : j + len(CLOSE)]):
            return [], start  # the closing tag may be coming
        elif j < len(section):
            raise NotCalls(f"{CLOSE} expected")
        return [call_from(obj)], end

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
