"""The n-gram (prompt lookup) proposer: longest suffix first, most recent occurrence among equal
lengths, at most k tokens, nothing when no suffix of length >= ngram_min recurs; incremental
history matches a from-scratch lookup (checked against a plain-Python oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkern.engine import SamplingParams
from pagedkern.engine.request import Request
from pagedkern.engine.speculative.ngram import NgramProposer, lookup


def oracle(ids: list[int], ngram_min: int, ngram_max: int, k: int) -> tuple[int, ...]:
    """Plain Python: for n from max down to min, the latest earlier occurrence of the last n
    ids, and the (up to) k ids after it."""
    for n in range(min(ngram_max, len(ids) - 1), ngram_min - 1, -1):
        suffix = ids[len(ids) - n :]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                return tuple(ids[start + n : start + n + k])
    return ()


def test_proposes_what_followed_the_longest_match():
    ids = np.array([1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3])
    # suffix [1, 2, 3] occurs at 0 (followed by 9, 9, 7); [2, 3] later at 6 is shorter
    assert lookup(ids, 1, 3, 3) == (9, 9, 7)
    assert lookup(ids, 1, 2, 3) == (4, 5, 6)  # n <= 2: the most recent [2, 3]
    assert lookup(ids, 1, 3, 1) == (9,)
    assert lookup(ids, 4, 4, 3) == ()  # no 4-gram recurs


def test_no_match_and_short_sequences_propose_nothing():
    assert lookup(np.array([1, 2, 3, 4]), 1, 3, 4) == ()
    assert lookup(np.array([5]), 1, 3, 4) == ()
    assert lookup(np.array([5, 5]), 1, 3, 0) == ()
    assert lookup(np.array([5, 5]), 1, 3, 4) == (5,)  # the follower runs into the end


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_lookup_equals_the_oracle(ids, ngram_min, extra, k):
    ngram_max = ngram_min + extra
    got = lookup(np.array(ids, dtype=np.int64), ngram_min, ngram_max, k)
    assert got == oracle(ids, ngram_min, ngram_max, k)


def test_incremental_history_follows_the_output():
    proposer = NgramProposer(1, 3)
    request = Request("R", (1, 2, 3, 4, 1, 2), SamplingParams())
    (first,) = proposer.propose([request], [2])
    assert first.token_ids == (3, 4) and first.draft_probs is None
    for token in (3, 4, 8, 1, 2, 3):  # the history grows past its first buffer
        request.output_ids.append(token)
    request.output_ids.extend(range(10, 200))
    request.output_ids.extend([1, 2, 3])
    (later,) = proposer.propose([request], [4])
    # the first proposal's 2 tokens were accepted: the next proposes at most 2 + 1
    assert later.token_ids == oracle(request.all_ids, 1, 3, 3) and len(later.token_ids) == 3
    proposer.forget(request)
    rebuilt = proposer.propose([request], [4])[0].token_ids
    assert rebuilt == oracle(request.all_ids, 1, 3, 4) and len(rebuilt) == 4  # window reset


def test_the_window_shrinks_after_rejections_and_grows_back():
    proposer = NgramProposer(1, 2)
    request = Request("R", (1, 2, 3, 4, 5, 6, 7, 1, 2), SamplingParams())
    assert proposer.propose([request], [4])[0].token_ids == (3, 4, 5, 6)
    request.output_ids += [9, 1, 2]  # nothing accepted (9 came instead), then plain steps
    assert proposer.propose([request], [4])[0].token_ids == (9,)  # window 0 + 1
    request.output_ids += [9, 4]  # the one proposal accepted, then 4
    assert proposer.propose([request], [4])[0].token_ids == (5, 6)  # window 1 + 1


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)


def test_rejected_lone_guesses_back_off():
    proposer = NgramProposer(1, 1)
    request = Request("R", (1, 2, 1), SamplingParams())
    calls = []
    for step in range(12):
        (p,) = proposer.propose([request], [4])
        calls.append(p.token_ids)
        # a fresh token (never the one proposed), then 1 again: lookup always matches
        request.output_ids += [100 + step, 1]
    assert calls[0] == (2, 1)  # k = 4 capped by what follows; rejected: window 1
    assert len(calls[1]) == 1  # a lone guess, rejected: skip 2 steps
    assert calls[2:4] == [(), ()] and len(calls[4]) == 1  # rejected again: skip 4
    assert calls[5:9] == [()] * 4 and len(calls[9]) == 1
