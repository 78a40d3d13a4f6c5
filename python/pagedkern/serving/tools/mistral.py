"""Mistral calls: `[TOOL_CALLS]` then a JSON array (v0.3 tokenizers), or `[TOOL_CALLS]name
[ARGS]{...}` per call (v11+ tokenizers):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

`[TOOL_CALLS]` is a control token that the detokenizer drops, so an answer that opens with a
bare `[{` array is read as calls too."""

from __future__ import annotations

from .base import NotCalls, ToolCall, ToolParser, call_from, decode_json_prefix

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    starts = (MARKER,)
    starts_at_beginning = ("[{",)

    def take_calls(self, section: str, final: bool) -> tuple[list[ToolCall], int]:
        text = section.lstrip()
        skipped = len(section) - len(text)
        if not text:
            return [], 0
        array = not self._calls and not MARKER.startswith(text[: len(MARKER)])
        if array and text.startswith("["):  # a JSON array of calls
            decoded = decode_json_prefix(text)
            if decoded is None:
                if final:
                    raise NotCalls("an unfinished array of calls")
                return [], 0
            array, end = decoded
            if not isinstance(array, list) or not array:
                raise NotCalls("an array of calls expected")
            return [call_from(obj) for obj in array], skipped + end
        return self._named_calls(section, final)

    def _named_calls(self, section: str, final: bool) -> tuple[list[ToolCall], int]:
        calls: list[ToolCall] = []
        used = 0
        while True:
            i = used
            if calls or self._calls:  # after a call: only another marker continues
                i = len(section) - len(section[i:].lstrip())
                if not section.startswith(MARKER, i):  # (more to come, or trailing content)
                    return calls, used
                i += len(MARKER)
            at = section.find(ARGS, i)
            if at < 0:
                if final:
                    raise NotCalls(f"{ARGS} expected")
                return calls, used
            name = section[i:at].strip()
            decoded = decode_json_prefix(section, at + len(ARGS))
            if decoded is None:
                if final:
                    raise NotCalls("unfinished arguments")
                return calls, used
            args, end = decoded
            calls.append(call_from({"name": name, "arguments": args}))
            used = end
            if final and not section[used:].strip():
                return calls, len(section)

    @staticmethod
    def calls_grammar(call: str, parallel: bool, literal=None) -> str:  # (no tags)
        more = f'("," {call})*' if parallel else ""
        return f'calls: "[" {call} {more} "]"'
