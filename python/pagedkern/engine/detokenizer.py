"""Incremental detokenization with stop strings: text leaves the engine in deltas that are
always whole UTF-8 characters and never contain any part of a stop string.

A byte-level BPE token can end in the middle of a character; decoding the tail of the sequence
then yields U+FFFD, so the delta is held until a later token completes the character. Text that
could still be the beginning of a stop string is held back too, and released once it can no
longer match (or when the request ends for another reason). Before min_tokens ids have been
generated no stop string ends the request (as vLLM: min_tokens holds back EOS, stop ids and stop
strings alike); a stop string counts only if it ends in the text of the min_tokens-th id or later.

Cost per token: one decode of the window since the last emitted character (usually two ids);
the decode of the window before the new id is remembered between calls, and a one-id window's
text comes from a per-tokenizer cache, so it is decoded once per id, not once per token. For a
byte-level BPE (`_concatenates`) an id whose own text is whole characters, after text that
ended on one, is its cached text and no decode at all (the usual token). With
stop strings (S strings of length <= L, bounded by SamplingParams): one set check of the new
text plus L characters against the stop strings' first characters, and only when one is there
one `find` per stop string over that window and at most L - 1 binary searches of the sorted
stop strings for the held-back tail; nothing depends on other requests.
"""

from __future__ import annotations

import bisect
import json
import random
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from ..model.tokenizer import Tokenizer


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# tokenizer -> {id: text of that id alone}: a pure function of the tokenizer, shared by its
# requests (the window before a new id is a single id whenever the last id completed text).
_ONE_ID_TEXT: weakref.WeakKeyDictionary[object, dict[int, str]] = weakref.WeakKeyDictionary()


_TRIM_AFTER = 2048  # characters of emitted text kept before trimming the front
CONTEXT_IDS = 4  # prompt ids decoded before the first generated one (vLLM keeps 5)


# tokenizer -> whether its decode is byte concatenation (see _concatenates)
_CONCATENATES: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()


def _concatenates(tokenizer: Decoder) -> bool:
    """Whether decode(ids) is the lossy UTF-8 decode of the ids' bytes joined (special ids: no
    bytes): a byte-level BPE's ByteLevel decoder (GPT-2, Llama 3, Qwen, SmolLM), nothing that
    strips, replaces or cleans up. Then an id whose text alone is whole characters, appended
    after text that ended on a whole character, adds exactly that text, and add() needs no
    decode. Decided from the tokenizer's own description, and checked on sample pairs."""
    backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
    if not hasattr(backend, "to_str"):  # not a `tokenizers` tokenizer: no description
        return False
    try:
        return _CONCATENATES[tokenizer]
    except KeyError:
        pass
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    result = bool(parts) and all(part.get("type") == "ByteLevel" for part in parts)
    if result:
        decode = backend.decode
        vocab = backend.get_vocab_size()
        rng = random.Random(0)
        pairs = [(rng.randrange(vocab), rng.randrange(vocab)) for _ in range(64)]
        alone = {i: decode([i], skip_special_tokens=True) for pair in pairs for i in pair}
        result = all(
            decode([a, b], skip_special_tokens=True) == alone[a] + alone[b]
            for a, b in pairs
            if "\ufffd" not in alone[a]
        )
    _CONCATENATES[tokenizer] = result
    return result


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        context: Sequence[int] = (),
    ):
        """context: the last prompt ids (CONTEXT_IDS of them), decoded before the first
        generated id so that its text is what it adds after them: a SentencePiece decoder
        strips the space a sequence's first piece begins with ("▁Paris" alone is "Paris"),
        which the first generated piece must keep."""
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        # Our Tokenizer's decode only converts the ids to int, which add() already does.
        backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
        self._decode_ids: Callable[..., str] = backend.decode
        try:
            self._one_id_text = _ONE_ID_TEXT.setdefault(tokenizer, {})
        except TypeError:  # not weakly referenceable: a cache of this request's own
            self._one_id_text = {}
        try:
            self._concat = _concatenates(tokenizer)
        except TypeError:  # not weakly referenceable
            self._concat = False
        self.stop = tuple(s for s in stop if s)
        self._sorted_stop = sorted(self.stop)
        self._max_stop = max(map(len, self.stop), default=0)
        self._stop_starts = frozenset(s[0] for s in self.stop)
        self.ids: list[int] = [int(i) for i in context[len(context) - CONTEXT_IDS :]]
        self._first = len(self.ids)  # ids[first:] are the generated ones
        self.text = ""  # decoded so far (whole characters), less a front trimmed in _emit
        self.emitted = 0  # characters of self.text already returned
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to the text's tail
        self._read_offset = self._first
        self._before = -1 if self._first else 0  # len(decode(ids[prefix:read])), -1: unknown
        self.stopped_by: str | None = None
        self._stop_from = 0  # a stop string counts only if it ends after this many characters

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text that may be emitted now (maybe empty).
        After a stop string is found, `stopped_by` is set and nothing more is emitted."""
        if self.stopped_by is not None:
            return ""
        if len(self.ids) - self._first < self.min_tokens:
            self._stop_from = len(self.text)  # text so far is from ids before the min_tokens-th
        ids = self.ids
        token = int(token_id)
        ids.append(token)
        prefix, read = self._prefix_offset, self._read_offset
        if self._concat and read == len(ids) - 1:  # the text so far ends on a whole character
            piece = self._one_id_text.get(token)
            if piece is None:
                piece = self._window(read, read + 1)  # (decoded once per id, then cached)
            # so does this id's text ("" is a skipped special id): that text is the delta
            if piece and "\ufffd" not in piece:
                self.text += piece
                self._prefix_offset, self._read_offset, self._before = read, read + 1, len(piece)
                return self._release() if self.stop else self._emit(len(self.text))
        before = self._before
        if before < 0:
            before = self._before = len(self._window(prefix, read))
        after = self._decode_ids(ids[prefix:], skip_special_tokens=True)
        if len(after) > before and not after.endswith("\ufffd"):
            self.text += after[before:]
            self._prefix_offset, self._read_offset = read, len(ids)
            self._before = -1
        return self._release() if self.stop else self._emit(len(self.text))

    def _window(self, start: int, end: int) -> str:
        """The text of ids[start:end] decoded on their own (special tokens skipped)."""
        if end - start == 1:
            token = self.ids[start]
            text = self._one_id_text.get(token)
            if text is None:
                text = self._one_id_text[token] = self._decode_ids(
                    [token], skip_special_tokens=True
                )
            return text
        return (
            self._decode_ids(self.ids[start:end], skip_special_tokens=True) if end > start else ""
        )

    def _release(self) -> str:
        """With stop strings: cut at the first one found, else emit all but the held-back tail."""
        start = max(0, self.emitted - self._max_stop + 1)
        if self._stop_starts.isdisjoint(self.text[start:]):
            # the usual token: nothing from `start` on begins a stop string, so none is found
            # there and no tail is held back (it would begin in the unemitted text, past start)
            return self._emit(len(self.text))
        hits = [(i, s) for s in self.stop if (i := self._find(s, start)) >= 0]
        if hits:
            cut, self.stopped_by = min(hits)
            self.text = self.text[:cut]
            return self._emit(cut)
        return self._emit(len(self.text) - self._held_back())

    def _find(self, stop: str, start: int) -> int:
        """The first occurrence of `stop` at or after `start` that may end the request: -1 before
        min_tokens, and never one lying wholly in the text of the ids before the min_tokens-th."""
        if len(self.ids) - self._first < self.min_tokens:
            return -1
        start = max(start, self._stop_from - len(stop) + 1)
        return self.text.find(stop, start)

    def _held_back(self) -> int:
        """Length of the longest unemitted tail of the text that begins some stop string."""
        text, stops = self.text, self._sorted_stop
        longest = min(self._max_stop - 1, len(text) - self.emitted)
        if longest <= 0 or self._stop_starts.isdisjoint(text[-longest:]):
            return 0  # the usual case: no character that could begin a stop string
        for n in range(longest, 0, -1):
            if text[-n] not in self._stop_starts:
                continue
            tail = text[-n:]
            i = bisect.bisect_left(stops, tail)  # the first stop string >= tail
            if i < len(stops) and stops[i].startswith(tail):
                return n
        return 0

    def _emit(self, end: int) -> str:
        emitted = self.emitted
        if end <= emitted:
            return ""
        delta = self.text[emitted:end]
        if end > _TRIM_AFTER:  # drop what no stop-string search reads again (bounds text +=)
            cut = end - self._max_stop
            self.text, end = self.text[cut:], end - cut
            self._stop_from = max(0, self._stop_from - cut)
        self.emitted = end
        return delta

    def flush(self) -> str:
        """At the end of a request: the text of the ids that waited for a character's remaining
        bytes (as the whole output's decode shows them: U+FFFD for what never came), then the
        text held back for a stop string that never came (a stop string may end in the former)."""
        if self.stopped_by is not None:
            return ""
        prefix, read = self._prefix_offset, self._read_offset
        if read < len(self.ids):
            before = len(self._window(prefix, read))
            after = self._decode_ids(self.ids[prefix:], skip_special_tokens=True)
            if len(after) > before:
                self.text += after[before:]
                self._prefix_offset, self._read_offset, self._before = read, len(self.ids), -1
                if self.stop:
                    released = self._release()
                    if self.stopped_by is not None:
                        return released
                    return released + self._emit(len(self.text))
        return self._emit(len(self.text))
