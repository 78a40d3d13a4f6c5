"""N-gram (prompt lookup) proposer: find the request's last n tokens earlier in its own prompt +
output, longest n first (n from ngram_max down to ngram_min, the most recent occurrence among
equally long matches), and propose the k tokens that followed that occurrence.

Cost: each request keeps its ids in a growing numpy buffer, appended to with only the tokens
generated since the last call (no per-step copy of the whole sequence). A lookup is one
vectorised comparison against the last token over the sequence, then at most ngram_max - 1
comparisons over the candidates it found: O(length) per request and step, in C, so refusing
(no match) is cheap. Proposals are point masses (`draft_probs` None).

Wasted verification rows cost real compute where the model is not memory-bound (the CPU, large
batches), so each request's proposal length adapts: after a verification that accepted a of its
proposals (read off the tokens it gained) it proposes at most a + 1 next time, up to k; a single
guess rejected makes it skip lookups for 2, 4, ... 32 steps (reset by an acceptance). Text that
quotes its prompt keeps k; text that does not soon costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..request import Request
from .proposer import Proposal

_NOTHING = Proposal(())
MAX_BACKOFF = 32  # most steps a request skips lookups after a rejected lone guess


class _History:
    """One request's prompt + output ids in a buffer that doubles when full."""

    def __init__(self, request: Request):
        ids = request.prompt_ids
        self.buffer = np.empty(max(64, 2 * (len(ids) + len(request.output_ids))), np.int64)
        self.length = 0
        self.num_prompt = len(ids)
        self._extend(ids)
        self.proposed: tuple[int, ...] = ()  # the last proposal, verified since
        self.window: int | None = None  # the most it proposes next (None: k)
        self.backoff = 0  # steps skipped after the last lone guess was rejected
        self.skip = 0  # steps still to skip

    def _extend(self, ids: Sequence[int]) -> None:
        end = self.length + len(ids)
        if end > len(self.buffer):
            grown = np.empty(2 * end, np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        self.buffer[self.length : end] = ids
        self.length = end

    def sync(self, request: Request) -> np.ndarray:
        """The ids so far (a view), after appending the outputs generated since the last call
        (and adapting the window to how much of the last proposal they accepted)."""
        seen = self.length - self.num_prompt
        gained = request.output_ids[seen:]
        if gained:
            self._extend(gained)
        if self.proposed and gained:
            accepted = 0
            for want, got in zip(self.proposed, gained[:-1]):
                if want != got:
                    break
                accepted += 1
            if accepted == 0 and len(self.proposed) == 1:
                self.backoff = min(MAX_BACKOFF, max(2, 2 * self.backoff))
                self.skip = self.backoff
            elif accepted:
                self.backoff = 0
            self.window = accepted + 1
            self.proposed = ()
        return self.buffer[: self.length]


def lookup(ids: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> tuple[int, ...]:
    """Up to k ids that followed the most recent earlier occurrence of the longest suffix of
    `ids` of length in [ngram_min, ngram_max] (empty when no such suffix recurs)."""
    length = len(ids)
    if k <= 0 or length <= ngram_min:
        return ()
    # ends[i]: an earlier position whose token equals the last one (the end of a candidate
    # occurrence; it has at least one follower since it is before the last position)
    ends = np.flatnonzero(ids[: length - 1] == ids[length - 1])
    if ends.size == 0:
        return ()
    matched = np.ones(ends.size, dtype=np.int64)  # suffix length each candidate matches
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(ngram_max, length - 1)):
        start_ok = ends >= back
        same = np.zeros(ends.size, dtype=bool)
        same[start_ok] = ids[ends[start_ok] - back] == ids[length - 1 - back]
        alive &= same
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < ngram_min:
        return ()
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the most recent longest match
    return tuple(int(t) for t in ids[end + 1 : min(end + 1 + k, length)])


class NgramProposer:
    """Proposer (engine/speculative/proposer.py) by prompt lookup."""

    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._histories: dict[Request, _History] = {}

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Proposal]:
        proposals = []
        for request, k in zip(requests, max_tokens, strict=True):
            history = self._histories.get(request)
            if history is None:
                history = self._histories[request] = _History(request)
            ids = history.sync(request)
            if history.skip:
                history.skip -= 1
                proposals.append(_NOTHING)
                continue
            window = k if history.window is None else min(k, history.window)
            found = lookup(ids, self.ngram_min, self.ngram_max, window)
            history.proposed = found
            proposals.append(Proposal(found) if found else _NOTHING)
        return proposals

    def forget(self, request: Request) -> None:
        self._histories.pop(request, None)
