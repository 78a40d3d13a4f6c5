"""The tool-call parser interface: a model's answer text, fed in pieces as it streams, split into
plain content and complete tool calls.

Every family writes its calls as markup around JSON, after (or instead of) some plain text:
Hermes `<tool_call>{...}</tool_call>`, Llama 3 `{"name", "parameters"}`, Mistral
`[TOOL_CALLS][...]`, the generic `{"tool_calls": [...]}`. A parser is streaming first:
`feed(text)` returns the content that can be shown now and the calls completed by this piece,
`finish()` what is left. Text that may still turn out to be markup (a partial `<tool_ca`, or a
section of calls not yet closed) is held back, so no markup leaks into content; a section that
never parses as calls is given back as content at the end (never an error). The non-streamed
answer is the same machine fed the whole text at once (`parse`), so a stream's concatenated
deltas equal it by construction.

A family subclass says where its calls start (`starts`, or `starts_at_beginning`: a JSON value
the answer opens with) and how to read complete calls from the call section (`take_calls`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: `arguments` is JSON text (OpenAI's function.arguments)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class Parsed:
    """What one piece of text yields: content to show and calls completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class NotCalls(ValueError):
    """The call section does not parse as this family's calls, and no more text can change
    that (an incomplete one is not an error: take_calls waits for more)."""


# A call ends in one of these (a JSON object or array, a closing tag): a piece without any
# cannot complete one, so the section is not parsed again for it (a long argument string
# costs one parse per closing bracket, not one per token).
CLOSERS = "}]>"


def call_from(obj: Any, arguments_key: str = "arguments") -> ToolCall:
    """A ToolCall from a decoded {"name": str, <arguments_key>: object or JSON text}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise NotCalls("a call needs a name")
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as exc:  # (nested past Python's stack)
            raise NotCalls("arguments are not JSON") from exc
    if not isinstance(args, dict):
        raise NotCalls("arguments must be an object")
    try:
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except RecursionError as exc:
        raise NotCalls("the arguments nest too deeply") from exc


def decode_json_prefix(text: str, start: int = 0) -> tuple[Any, int] | None:
    """The JSON value at text[start:] (after whitespace) and where it ends; None while it is
    incomplete. NotCalls when it can never become JSON."""
    decoder = json.JSONDecoder()
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i == len(text):
        return None
    try:
        return decoder.raw_decode(text, i)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text) or _open_at_end(text[i:]):
            return None  # ran out of text: more may complete it
        raise NotCalls(str(exc)) from None
    except RecursionError:  # nested past Python's stack: no text after it can make it calls
        raise NotCalls("the JSON nests too deeply") from None


def _open_at_end(text: str) -> bool:
    """Whether some bracket or string is still open at the end of `text` (a JSON prefix)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_string or depth > 0


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ToolParser:
    """One answer's streaming splitter (one instance per choice). Subclasses set `name`,
    `starts` and/or `starts_at_beginning`, and implement `take_calls`."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]] = ()  # markers that open the call section anywhere
    starts_at_beginning: ClassVar[tuple[str, ...]] = ()  # ... only as the answer's first text

    def __init__(self) -> None:
        self._pending = ""  # content held back (could be the start of a marker)
        self._section: str | None = None  # the call section's unconsumed text, once entered
        self._section_all = ""  # the whole section as written (given back if it fails)
        self._seen_text = False  # non-space content has been shown
        self._calls = 0
        self._stuck = False  # the section stopped parsing (no more text can make it calls)

    def take_calls(self, section: str, final: bool) -> tuple[list[ToolCall], int]:
        """Complete calls at the start of `section` (the text after the opening marker, less
        what earlier calls consumed) and how many characters they used. final: no more text
        will come. Raises NotCalls when the section cannot be calls."""
        raise NotImplementedError

    @staticmethod
    def calls_grammar(call: str, parallel: bool, literal: Callable[[str], str]) -> str:
        """The Lark rule `calls` that forces this family's markup around one call (several
        with parallel): `call` is the rule of one call's JSON, literal(text) the expression
        of a tag (grammar.literal: its text, or its token)."""
        raise NotImplementedError

    # --- streaming ---------------------------------------------------------------------------

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self._section is not None:
            self._section += text
            self._section_all += text
            if self._stuck or not any(c in text for c in CLOSERS):
                return out  # no call can have completed: parsing again would find nothing
            return self._drain(out, final=False)
        text = self._pending + text
        self._pending = ""
        if not self._seen_text:
            stripped = text.lstrip()
            head = len(text) - len(stripped)
            for marker in self.starts_at_beginning:
                if stripped.startswith(marker):
                    return self._enter(out, text[:head], text[head:], marker)
                if marker.startswith(stripped):  # could still become it
                    self._pending = text
                    return out
        cut, marker = self._find_start(text)
        if cut is not None:
            return self._enter(out, text[:cut], text[cut:], marker)
        keep = partial_suffix(text, self.starts)
        shown = text[: len(text) - keep]
        self._pending = text[len(text) - keep :]
        out.content += shown
        self._seen_text = self._seen_text or bool(shown.strip())
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._section is None:
            out.content, self._pending = self._pending, ""
            return out
        return self._drain(out, final=True)

    def parse(self, text: str) -> Parsed:
        """The whole answer at once (a fresh parser's feed + finish)."""
        out = self.feed(text)
        out += self.finish()
        return out

    # --- internals ---------------------------------------------------------------------------

    def _find_start(self, text: str) -> tuple[int | None, str]:
        found, which = None, ""
        for marker in self.starts:
            at = text.find(marker)
            if at >= 0 and (found is None or at < found):
                found, which = at, marker
        return found, which

    def _enter(self, out: Parsed, before: str, rest: str, marker: str) -> Parsed:
        out.content += before
        self._section_all = rest
        # a marker that opens JSON (`{`, `[{`) is part of the first call; others are skipped
        self._section = rest if marker.startswith(("{", "[{")) else rest[len(marker) :]
        return self._drain(out, final=False)

    def _drain(self, out: Parsed, final: bool) -> Parsed:
        """Take the complete calls; at the end, give back what never became calls: the whole
        section (marker included) when it held none, else the text after the last call."""
        assert self._section is not None
        calls: list[ToolCall] = []
        used = 0
        if not self._stuck:
            try:
                calls, used = self.take_calls(self._section, final)
            except NotCalls:  # for good: held back until the end, then given back
                self._stuck = True
        self._section = self._section[used:]
        self._calls += len(calls)
        out.calls.extend(calls)
        if final:
            if self._calls == 0:
                out.content += self._section_all
            elif self._section.strip():
                out.content += self._section.strip()
            self._section = ""
        return out
