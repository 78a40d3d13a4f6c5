"""Incremental detokenization with stop strings: text leaves the engine in deltas that are
always whole UTF-8 characters and never contain any part of a stop string.

A byte-level BPE token can end in the middle of a character; decoding the tail of the sequence
then yields U+FFFD, so the delta is held until a later token completes the character. Text that
could still be the beginning of a stop string is held back too, and released once it can no
longer match (or when the request ends for another reason). Before min_tokens ids have been
generated no stop string ends the request (as vLLM: min_tokens holds back EOS, stop ids and stop
strings alike); a stop string counts only if it ends in the text of the min_tokens-th id or later.

Cost per token, bounded by SamplingParams' limits on stop strings (S strings of length <= L):
one `find` per stop string over the new text plus L characters, and at most L - 1 binary
searches of the sorted stop strings for the held-back tail; nothing depends on other requests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.stop = tuple(s for s in stop if s)
        self._sorted_stop = sorted(self.stop)
        self._max_stop = max(map(len, self.stop), default=0)
        self._stop_starts = frozenset(s[0] for s in self.stop)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (whole characters)
        self.emitted = 0  # characters of self.text already returned
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to the text's tail
        self._read_offset = 0
        self.stopped_by: str | None = None
        self._stop_from = 0  # a stop string counts only if it ends after this many characters

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text that may be emitted now (maybe empty).
        After a stop string is found, `stopped_by` is set and nothing more is emitted."""
        if self.stopped_by is not None:
            return ""
        if len(self.ids) < self.min_tokens:
            self._stop_from = len(self.text)  # text so far is from ids before the min_tokens-th
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _release(self) -> str:
        if self.stop:
            start = max(0, self.emitted - self._max_stop + 1)
            hits = [(i, s) for s in self.stop if (i := self._find(s, start)) >= 0]
            if hits:
                cut, self.stopped_by = min(hits)
                self.text = self.text[:cut]
                return self._emit(cut)
            return self._emit(len(self.text) - self._held_back())
        return self._emit(len(self.text))

    def _find(self, stop: str, start: int) -> int:
        """The first occurrence of `stop` at or after `start` that may end the request: -1 before
        min_tokens, and never one lying wholly in the text of the ids before the min_tokens-th."""
        if len(self.ids) < self.min_tokens:
            return -1
        start = max(start, self._stop_from - len(stop) + 1)
        return self.text.find(stop, start)

    def _held_back(self) -> int:
        """Length of the longest unemitted tail of the text that begins some stop string."""
        text, stops = self.text, self._sorted_stop
        for n in range(min(self._max_stop - 1, len(text) - self.emitted), 0, -1):
            if text[-n] not in self._stop_starts:
                continue
            tail = text[-n:]
            i = bisect.bisect_left(stops, tail)  # the first stop string >= tail
            if i < len(stops) and stops[i].startswith(tail):
                return n
        return 0

    def _emit(self, end: int) -> str:
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def flush(self) -> str:
        """At the end of a request: release text held back for a stop string that never came."""
        return self._emit(len(self.text)) if self.stopped_by is None else ""
