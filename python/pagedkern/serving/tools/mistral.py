"""Mistral calls: `[TOOL_CALLS]` then a JSON array (v0.3 tokenizers), or `[TOOL_CALLS]name
[ARGS]{...}` per call (v11+ tokenizers):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

`[TOOL_CALLS]` is a control token that the detokenizer drops, so an answer that opens with a
bare `[{` array is read as calls too."""

from __future__ import annotations

import re

from .base import NotCalls, ToolCall, ToolParser, call_from, next_json
from .spec import MAX_NAME, NAME_CHARS

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAME_RUN = re.compile(f"[{NAME_CHARS}]*")


class MistralToolParser(ToolParser):
    name = "mistral"
    starts = (MARKER,)
    starts_at_beginning = ("[{",)

    def take_calls(self, section: str, start: int, final: bool) -> tuple[list[ToolCall], int]:
        i = _skip_space(section, start)
        if i == len(section):
            return [], start
        if not self._calls and section.startswith("[", i):  # a JSON array of calls
            decoded = next_json(section, i, final, "array of calls")
            if decoded is None:
                return [], start
            array, end = decoded
            if not isinstance(array, list) or not array:
                raise NotCalls("an array of calls expected")
            return [call_from(obj) for obj in array], end
        if self._calls:  # after a call: only another marker continues
            if not section.startswith(MARKER, i):
                if not final and MARKER.startswith(section[i : i + len(MARKER)]):
                    return [], start  # (the marker may be coming)
                raise NotCalls(f"only {MARKER} may follow a call")  # the rest is content
            i = _skip_space(section, i + len(MARKER))
        # the name: a function name's characters, then [ARGS] (a bounded look, not a search)
        last = NAME_RUN.match(section, i, min(len(section), i + MAX_NAME + 1)).end()
        name, at = section[i:last], _skip_space(section, last)
        if not section.startswith(ARGS, at):
            if final or last - i > MAX_NAME or not ARGS.startswith(section[at : at + len(ARGS)]):
                raise NotCalls(f"a function name and {ARGS} expected")
            return [], start
        decoded = next_json(section, at + len(ARGS), final, "arguments object")
        if decoded is None:
            return [], start
        args, end = decoded
        return [call_from({"name": name, "arguments": args})], end

    @staticmethod
    def calls_grammar(call: str, parallel: bool, literal=None) -> str:  # (no tags)
        more = f'("," {call})*' if parallel else ""
        return f'calls: "[" {call} {more} "]"'


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
