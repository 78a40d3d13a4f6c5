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
the answer opens with) and how to read the next complete call(s) from the call section
(`take_calls`, one unit at a time: a call, or an array of them).

What comes out, for any text cut into any pieces: the calls and content of the whole text at once
(a call is only shown once no later text can undo it); each call's name a function name (OpenAI's
rule) and its arguments a JSON object, re-serialized (UTF-8-encodable, no NaN). Text is kept
verbatim as content except the markup and JSON of the calls taken, and the whitespace around the
text after the last call (that text comes back stripped). The work is linear in the text: the
section is parsed again only when a piece closes something at its top level (`JsonDepth`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .spec import NAME


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


# Lone surrogates (from JSON escapes like "\ud800"): text holding one cannot be UTF-8 encoded.
_SURROGATE = re.compile("[\ud800-\udfff]")


def call_from(obj: Any, arguments_key: str = "arguments") -> ToolCall:
    """A ToolCall from a decoded {"name": str, <arguments_key>: object or JSON text}."""
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not NAME.fullmatch(name):  # (no tool can have another)
        raise NotCalls("a call needs a function name")
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as exc:  # (nested past Python's stack)
            raise NotCalls("arguments are not JSON") from exc
    if not isinstance(args, dict):
        raise NotCalls("arguments must be an object")
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except RecursionError as exc:
        raise NotCalls("the arguments nest too deeply") from exc
    except ValueError as exc:  # NaN or a number past a float's range: JSON has neither
        raise NotCalls("the arguments hold a number JSON cannot write") from exc
    if _SURROGATE.search(text):  # escaped instead, or the response would fail to encode
        text = json.dumps(args)
    return ToolCall(name, text)


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
        if exc.pos >= len(text) or _open_at_end(text, i):
            return None  # ran out of text: more may complete it
        raise NotCalls(str(exc)) from None
    except ValueError:  # an integer past Python's digit limit: more digits cannot help
        raise NotCalls("a number too long") from None
    except RecursionError:  # nested past Python's stack: no text after it can make it calls
        raise NotCalls("the JSON nests too deeply") from None


def next_json(text: str, start: int, final: bool, what: str) -> tuple[Any, int] | None:
    """decode_json_prefix for a parser's next unit: None while more text may complete it; at
    the end (final) an incomplete one is NotCalls("an unfinished <what>")."""
    decoded = decode_json_prefix(text, start)
    if decoded is None and final:
        raise NotCalls(f"an unfinished {what}")
    return decoded


def _open_at_end(text: str, start: int = 0) -> bool:
    """Whether some bracket or string is still open at the end of `text[start:]` (JSON)."""
    depth = JsonDepth()
    depth.read(text, start)
    return depth.in_string or depth.depth > 0


_OUTSIDE = re.compile(r'["{}\[\]>]')
_INSIDE = re.compile(r'["\\]')


class JsonDepth:
    """The bracket depth and string state of JSON read so far, piece by piece. Brackets are
    counted whatever their kind, as a JSON prefix's: what matters is whether one is open."""

    __slots__ = ("depth", "escaped", "in_string")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def read(self, text: str, start: int = 0) -> bool:
        """Reads text[start:]; whether it closed something at the top level, outside strings:
        a `}` or `]` back to depth 0 (or below), or a `>` there (a closing tag). Only such a
        piece can complete a call: a call section's JSON or tag."""
        closed, i, n = False, start, len(text)
        if self.escaped and i < n:
            i, self.escaped = i + 1, False
        while i < n:
            found = (_INSIDE if self.in_string else _OUTSIDE).search(text, i)
            if found is None:
                break
            i, ch = found.end(), found.group()
            if ch == '"':
                self.in_string = not self.in_string
            elif ch == "\\":  # (in a string) the next character is escaped
                if i < n:
                    i += 1
                else:
                    self.escaped = True
            elif ch in "{[":
                self.depth += 1
            elif ch == ">":
                closed = closed or self.depth <= 0
            else:
                self.depth -= 1
                closed = closed or self.depth <= 0
        return closed


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
        self._more: list[str] = []  # pieces not yet added to _section (joined when parsed)
        self._marker = ""  # the marker skipped before _section (given back if no calls)
        self._depth = JsonDepth()  # over _section and _more
        self._seen_text = False  # non-space content has been shown
        self._calls = 0
        self._stuck = False  # the section stopped parsing (no more text can make it calls)

    def take_calls(self, section: str, start: int, final: bool) -> tuple[list[ToolCall], int]:
        """The next complete call(s) in `section` (the text after the opening marker) at
        `start` (after the calls taken): one call, or one array of them, and where they end;
        ([], start) while more text may complete them (or, final, when only space is left).
        final: no more text will come. Raises NotCalls when the text at `start` can never be
        calls. Either only from the text so far, whatever follows it: a stream's calls are
        then the whole answer's."""
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
            self._more.append(text)
            if self._stuck or not self._depth.read(text):
                return out  # no call can have completed: parsing again would find nothing
            return self._drain(out, final=False)
        text = self._pending + text
        self._pending = ""
        if not self._seen_text:
            stripped = text.lstrip()
            # leading space is content whatever follows (not held: it could grow without end)
            out.content, text = text[: len(text) - len(stripped)], stripped
            for marker in self.starts_at_beginning:
                if text.startswith(marker):
                    return self._enter(out, "", text, marker)
                if marker.startswith(text):  # could still become it
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
        # a marker that opens JSON (`{`, `[{`) is part of the first call; others are skipped
        self._marker = "" if marker.startswith(("{", "[{")) else marker
        self._section = rest[len(self._marker) :]
        self._depth.read(self._section)
        return self._drain(out, final=False)

    def _drain(self, out: Parsed, final: bool) -> Parsed:
        """Take the complete calls; at the end, give back what never became calls: the whole
        section (marker included) when it held none, else the text after the last call."""
        assert self._section is not None
        if self._more:
            self._section += "".join(self._more)
            self._more.clear()
        used = 0
        while not self._stuck:
            try:
                calls, end = self.take_calls(self._section, used, final)
            except NotCalls:  # for good: held back until the end, then given back
                self._stuck = True
                break
            if not calls:
                break
            # (calls after others may fail: each unit is taken, and shown, on its own)
            used = end
            self._calls += len(calls)
            out.calls.extend(calls)
        if used:  # (once per drain: a long answer of many calls is no quadratic work)
            self._section = self._section[used:]
            self._depth = JsonDepth()
            self._depth.read(self._section)
        if final:
            if self._calls == 0:
                out.content += self._marker + self._section
            elif self._section.strip():
                out.content += self._section.strip()
            self._section = ""
        return out
