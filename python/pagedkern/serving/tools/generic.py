"""The generic JSON format, for models whose chat template knows no tools (the default SmolLM2's
among them), after llama.cpp's generic handler: the system turn describes the tools
(prompting.py) and asks for a call as one JSON object, the whole answer:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}

(`{"tool_call": {...}}`, one call, is read too). Anything else is the answer's content."""

from __future__ import annotations

from .base import NotCalls, ToolCall, ToolParser, call_from, next_json


class GenericJsonToolParser(ToolParser):
    name = "generic"
    starts_at_beginning = ("{",)

    def take_calls(self, section: str, start: int, final: bool) -> tuple[list[ToolCall], int]:
        decoded = next_json(section, start, final, "JSON object")
        if decoded is None:
            return [], start
        obj, end = decoded
        if not isinstance(obj, dict):
            raise NotCalls("not an object")
        if isinstance(obj.get("tool_calls"), list) and obj["tool_calls"]:
            return [call_from(c) for c in obj["tool_calls"]], end
        if isinstance(obj.get("tool_call"), dict):
            return [call_from(obj["tool_call"])], end
        raise NotCalls("no tool_calls")

    @staticmethod
    def calls_grammar(call: str, parallel: bool, literal=None) -> str:  # (no tags)
        more = f'("," {call})*' if parallel else ""
        return f'calls: "{{\\"tool_calls\\":[" {call} {more} "]}}"'
