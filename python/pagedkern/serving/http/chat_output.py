"""Chat responses whose answers go through a ChatOutputParser (tools or reasoning): the
thinking in `reasoning_content`, tool calls in `tool_calls`, finish_reason "tool_calls" when
the answer called tools.

Streaming follows OpenAI's delta shape: `delta.reasoning_content` and `delta.content` as text
arrives (markup held back until it is known not to be a call), and per tool call, once it is
complete, one chunk `{"index", "id", "type": "function", "function": {"name", "arguments":
""}}` and one with `{"index", "function": {"arguments": "<JSON>"}}`, so a client
concatenating the deltas gets exactly the non-streamed message (the same parser reads the
whole answer there)."""

from __future__ import annotations

from collections.abc import Callable

from ..core.request_stream import StreamOutput
from ..tools.output import ChatOutputParser, ChatPiece
from .body_formats import CHUNK_SEPARATOR, ChatFormat, compact_json, json_string
from .response_models import AssistantMessage, ChatChoice


class ParsedChatFormat(ChatFormat):
    def __init__(self, *args, make_parser: Callable[[], ChatOutputParser], **kwargs):
        super().__init__(*args, **kwargs)
        self.make_parser = make_parser
        self.parsers = [make_parser() for _ in range(self.num_choices)]

    def delta(self, index: int, out: StreamOutput, finish_reason: str | None) -> str:
        """The chunk(s) of one output (several joined by CHUNK_SEPARATOR; "" for none)."""
        parser = self.parsers[index]
        first_call = parser.num_calls
        piece = parser.feed(out.text) if out.text else ChatPiece()
        if finish_reason is not None:
            piece += parser.finish()
            if finish_reason == "stop" and parser.num_calls:
                finish_reason = "tool_calls"
        logprobs = self.logprobs(index, out)
        deltas: list[dict] = []
        text: dict = {}
        if piece.reasoning:
            text["reasoning_content"] = piece.reasoning
        if piece.content:
            text["content"] = piece.content
        if text or logprobs is not None:
            deltas.append(text)
        for k, call in enumerate(piece.calls, start=first_call):
            function = {"name": call.name, "arguments": ""}
            deltas.append({"tool_calls": [
                {"index": k, "id": call.id, "type": "function", "function": function}
            ]})  # fmt: skip
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        if finish_reason is not None and not deltas:
            deltas.append({})
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            reason = "null" if finish_reason is None or not last else json_string(finish_reason)
            lp = "null" if logprobs is None or i else compact_json(logprobs)
            choice = (
                f'{{"index":{index},"delta":{compact_json(delta)},"finish_reason":{reason},'
                f'"logprobs":{lp}}}'
            )
            chunks.append(f"{self._head}{choice}{self._tail}")
        return CHUNK_SEPARATOR.join(chunks)

    def _whole_choice(self, index, text, finish_reason, logprobs):
        piece = self.make_parser().parse(text)
        calls = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in piece.calls
        ]  # fmt: skip
        if finish_reason == "stop" and calls:
            finish_reason = "tool_calls"
        message = AssistantMessage(
            content=piece.content if piece.content or not calls else None,
            tool_calls=calls or None,
            reasoning_content=piece.reasoning or None,
        )
        return ChatChoice(
            index=index, message=message, finish_reason=finish_reason, logprobs=logprobs
        )
