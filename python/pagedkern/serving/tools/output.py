"""One choice's answer split as it streams: the thinking (reasoning parser) first, then the
answer's content and tool calls (tool parser). Either parser may be absent."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import ToolCall, ToolParser
from .reasoning import ReasoningParser


@dataclass(slots=True)
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatPiece) -> ChatPiece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutputParser:
    def __init__(
        self,
        reasoning: type[ReasoningParser] | None = None,
        tools: type[ToolParser] | None = None,
    ):
        self.reasoning = reasoning() if reasoning is not None else None
        self.tools = tools() if tools is not None else None
        self.num_calls = 0

    def feed(self, text: str) -> ChatPiece:
        if self.reasoning is None:
            return self._answer(text, final=False)
        split = self.reasoning.feed(text)
        out = ChatPiece(reasoning=split.reasoning)
        out += self._answer(split.content, final=False)
        return out

    def finish(self) -> ChatPiece:
        out = ChatPiece()
        if self.reasoning is not None:
            split = self.reasoning.finish()
            out.reasoning = split.reasoning
            out += self._answer(split.content, final=False)
        out += self._answer("", final=True)
        return out

    def parse(self, text: str) -> ChatPiece:
        out = self.feed(text)
        out += self.finish()
        return out

    def _answer(self, text: str, final: bool) -> ChatPiece:
        if self.tools is None:
            return ChatPiece(content=text)
        parsed = self.tools.feed(text) if text else None
        out = ChatPiece()
        if parsed is not None:
            out.content, out.calls = parsed.content, parsed.calls
        if final:
            rest = self.tools.finish()
            out.content += rest.content
            out.calls.extend(rest.calls)
        self.num_calls += len(out.calls)
        return out
