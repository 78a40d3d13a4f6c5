"""Reasoning output: a thinking model's `<think>...</think>` moved out of the answer into
`reasoning_content` (vLLM's field), streamed as it comes.

Two families, as vLLM names them:
- "qwen3": thinking only when the answer opens with `<think>` (Qwen3's template may also
  switch it off: `chat_template_kwargs={"enable_thinking": false}`);
- "deepseek_r1": the prompt opens the thinking (the template ends with `<think>\\n`), so the
  answer starts inside it (a `<think>` it writes anyway is dropped); no `</think>` at all: all
  of it was thinking.
A partial tag at the end of a piece is held back until the next one settles it.

`ThinkingGrammar` is the thinking as Lark rules, so structured output and forced tool calls
constrain the answer after it, not the thinking itself (grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
# The thinking's text: anything without a </think> in it.
_THINKING_TEXT = r"THINK_TEXT: /(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/"


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One answer's splitter (one per choice): feed(text) -> Split, finish() -> Split."""

    name: ClassVar[str] = "qwen3"
    starts_inside: ClassVar[bool] = False  # the prompt opened the thinking

    def __init__(self) -> None:
        self._state = "start"
        self._held = ""  # a partial tag
        self._space: list[str] = []  # the space before the first text: whose, not yet known

    def feed(self, text: str) -> Split:
        out = Split()
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "start":  # before the first non-space text
                stripped = text.lstrip()
                if not stripped:  # (kept in pieces: joined once, however long it grows)
                    self._space.append(text)
                    return out
                if stripped.startswith(OPEN):  # the space before <think> is dropped
                    self._space.clear()
                    self._state, text = "inside", stripped[len(OPEN) :]
                    continue
                self._space.append(text[: len(text) - len(stripped)])
                if OPEN.startswith(stripped):  # may still become <think>
                    self._held = stripped
                    return out
                self._state = "inside" if self.starts_inside else "answer"
                text = "".join(self._space) + stripped
                self._space.clear()
            elif self._state == "inside":
                at = text.find(CLOSE)
                if at >= 0:
                    out.reasoning += text[:at]
                    self._state, text = "after", text[at + len(CLOSE) :]
                    continue
                keep = partial_suffix(text, (CLOSE,))
                out.reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                return out
            elif self._state == "after":  # the whitespace after </think> belongs to neither
                text = text.lstrip()
                if text:
                    self._state = "answer"
            else:
                out.content += text
                return out
        return out

    def finish(self) -> Split:
        held, self._held = "".join(self._space) + self._held, ""
        self._space.clear()
        if self._state == "inside" or (self._state == "start" and self.starts_inside):
            return Split(reasoning=held)
        return Split(content=held)

    @property
    def in_answer(self) -> bool:
        return self._state == "answer"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser_for_template(template: str | None) -> str | None:
    """The family a chat template shows: one whose generation prompt opens the thinking
    (`<think>` after add_generation_prompt, with no `</think>` there: Qwen3's closes an empty
    one when thinking is off) is DeepSeek-R1's kind, any other that mentions `<think>`
    Qwen3's; None without `<think>`."""
    if not template or OPEN not in template:
        return None
    tail = template[template.rfind("add_generation_prompt") :]
    return "deepseek_r1" if OPEN in tail and CLOSE not in tail else "qwen3"


@dataclass(frozen=True, slots=True)
class ThinkingGrammar:
    """The thinking as Lark rules (rule `think`), for the tokenizer at hand: where `<think>` /
    `</think>` are single tokens (Qwen3's, DeepSeek-R1's), llguidance treats them as special
    tokens, matched by id (`<[id]>`); otherwise as text."""

    parser: type[ReasoningParser]
    open_id: int | None = None
    close_id: int | None = None

    def rules(self) -> tuple[str, list[str]]:
        """(how `start` uses `think`, the rules)."""
        use = "think" if self.parser.starts_inside else "think?"
        opened = '"<think>"' if self.open_id is None else f'("<think>" | <[{self.open_id}]>)'
        if self.parser.starts_inside:
            opened += "?"
        if self.close_id is None:  # one regex: text up to the only </think>, then spaces
            return use, [
                f"think: {opened} THINK",
                r"THINK: /(.|\n)*<\/think>[ \t\r\n]*/ & ~/(.|\n)*<\/think>(.|\n)*<\/think>(.|\n)*/",
            ]
        return use, [
            f"think: {opened} THINK_TEXT <[{self.close_id}]> THINK_SPACE",
            _THINKING_TEXT,
            r"THINK_SPACE: /[ \t\r\n]*/",
        ]

    @classmethod
    def of(cls, parser: type[ReasoningParser], encode) -> ThinkingGrammar:
        """The rules for a tokenizer (`encode(text) -> ids`)."""
        ids = [encode(tag) for tag in (OPEN, CLOSE)]
        single = [i[0] if len(i) == 1 else None for i in ids]
        return cls(parser, single[0], single[1])
