"""Incremental detokenization: deltas are whole UTF-8 characters (Chinese and emoji split across
byte-level tokens are never emitted broken) and stop strings are never emitted, even partly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedkern.engine.detokenizer import IncrementalDetokenizer, _concatenates

TEXTS = [
    "The capital of France is Paris.",
    "法国的首都是巴黎。",
    "Emoji: 🎉🚀 and ZWJ 👩‍👩‍👧 done",
    "def f(x):\n    return x ** 2  # code\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    # Byte-level BPE with few merges: multi-byte characters span several tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["The capital of France is Paris. def return"] * 20, trainer)
    return tok


def stream(tok, text, stop=()):
    detok = IncrementalDetokenizer(tok, stop)
    deltas = [detok.add(i) for i in tok.encode(text).ids]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_join_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text).ids
    if not text.isascii():  # some character really is split across tokens
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok, deltas = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.stopped_by is None


@pytest.mark.parametrize("stop", [(), ("zz",), ("\ufffd",)])
def test_an_output_ending_inside_a_character_streams_what_its_decode_shows(tokenizer, stop):
    """The last ids wait for a character's remaining bytes that never come: the end of the
    stream gives them as the whole output's decode does (U+FFFD), or cuts at a stop string
    they complete."""
    ids = tokenizer.encode("ok 🎉").ids[:-1]
    whole = tokenizer.decode(ids)
    assert whole.endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, list(stop))
    deltas = [detok.add(i) for i in ids]
    assert "\ufffd" not in "".join(deltas)
    deltas.append(detok.flush())
    assert "".join(deltas) == (whole[: whole.index("\ufffd")] if "\ufffd" in stop else whole)
    assert detok.stopped_by == ("\ufffd" if "\ufffd" in stop else None)


@pytest.mark.parametrize(
    "text,stop,expected",
    [
        ("The capital of France is Paris. More", ["."], "The capital of France is Paris"),
        ("Answer: 巴黎。\nUser: next", ["\nUser:"], "Answer: 巴黎。"),
        ("abc STOP def STOP", ["STOP", "def"], "abc "),
        ("no stop string here", ["zzz"], "no stop string here"),
        ("ends with a partial sto", ["stop!"], "ends with a partial sto"),
        ("🎉🚀 party", ["🚀"], "🎉"),
    ],
)
def test_stop_strings_are_cut_and_never_leak(tokenizer, text, stop, expected):
    detok, deltas = stream(tokenizer, text, stop)
    assert "".join(deltas) == expected
    emitted = ""
    for delta in deltas:  # at no moment has any character past the cut been emitted
        emitted += delta
        assert expected.startswith(emitted)
    assert (detok.stopped_by is not None) == any(s in text for s in stop)


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["Paris!"])
    out = "".join(detok.add(i) for i in tokenizer.encode("Hello Par").ids)
    assert out == "Hello "  # "Par" could begin "Paris!"
    out += "".join(detok.add(i) for i in tokenizer.encode("is.").ids)
    assert out == "Hello Paris."  # it did not: released
    assert detok.flush() == ""


class CharTokenizer:
    """One id per character: the text is fully under the test's control."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=8),
)
def test_held_back_text_is_exactly_the_longest_tail_that_begins_a_stop_string(text, stop):
    # Against the plain definition, after every character: what is emitted is the text before
    # the first stop string, minus the longest tail that some stop string begins with.
    detok = IncrementalDetokenizer(CharTokenizer(), stop)
    emitted = ""
    for n, ch in enumerate(text, 1):
        emitted += detok.add(ord(ch))
        seen = text[:n]
        first = min((i for s in stop if (i := seen.find(s)) >= 0), default=None)
        if first is not None:
            assert detok.stopped_by is not None and emitted == seen[:first]
            return
        held = max((k for s in stop for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
        assert emitted == seen[: n - held]
    assert emitted + detok.flush() == text


@pytest.mark.parametrize("min_tokens", [0, 2, 3, 5, 6, 9])
def test_stop_strings_wait_for_min_tokens(min_tokens):
    # "ab" occurs ending at the 2nd, 6th and 9th id. A stop string counts only once min_tokens
    # ids exist and only if it ends in the text of the min_tokens-th id or later: the request
    # ends at the first such occurrence, and no earlier one is cut out.
    text = "abxyabzab"
    detok = IncrementalDetokenizer(CharTokenizer(), ["ab"], min_tokens)
    out = []
    for ch in text:
        out.append(detok.add(ord(ch)))
        if detok.stopped_by is not None:
            break
    out.append(detok.flush())
    end = next(e for e in (2, 6, 9, None) if e is None or e >= min_tokens)
    assert len(detok.ids) == (end or len(text))
    assert detok.stopped_by == ("ab" if end else None)
    assert "".join(out) == (text[: end - 2] if end else text)


def reference_deltas(tok, ids, stop) -> list[str]:
    """The first implementation, kept as the reference: both windows decoded for every token,
    the whole text kept."""
    stop = [s for s in stop if s]
    max_stop = max(map(len, stop), default=0)
    seen, text, emitted, prefix, read, deltas = [], "", 0, 0, 0, []

    def decode(window):
        return tok.decode(window, skip_special_tokens=True) if window else ""

    for token in ids:
        seen.append(token)
        before, after = decode(seen[prefix:read]), decode(seen[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            text += after[len(before) :]
            prefix, read = read, len(seen)
        hits = [(i, s) for s in stop if (i := text.find(s, max(0, emitted - max_stop + 1))) >= 0]
        if hits:
            cut = min(hits)[0]
            deltas.append(text[emitted:cut] if cut > emitted else "")
            return deltas
        held = max(
            (
                k
                for s in stop
                for k in range(1, len(s))
                if k <= len(text) - emitted and text.endswith(s[:k])
            ),
            default=0,
        )
        end = max(emitted, len(text) - held)
        deltas.append(text[emitted:end])
        emitted = end
    # the end: the ids that waited for a character's remaining bytes, as decode shows them
    before, after = decode(seen[prefix:read]), decode(seen[prefix:])
    if len(after) > len(before):
        text += after[len(before) :]
    hits = [(i, s) for s in stop if (i := text.find(s, max(0, emitted - max_stop + 1))) >= 0]
    end = min(hits)[0] if hits else len(text)
    deltas.append(text[emitted:end] if end > emitted else "")
    return deltas


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, 299), max_size=60),
    stop=st.lists(st.text(alphabet="aeirst \ufffd", min_size=1, max_size=4), max_size=3),
)
def test_deltas_equal_the_reference_on_any_ids(tokenizer, ids, stop):
    # Random byte-level ids: broken UTF-8, repeated one-id windows (the cache), stop strings.
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = [detok.add(i) for i in ids]
    expected = reference_deltas(tokenizer, ids, stop)
    if detok.stopped_by is None:
        deltas.append(detok.flush())
    assert deltas[: len(expected)] == expected
    assert all(d == "" for d in deltas[len(expected) :])  # nothing after a stop string


def test_the_byte_level_fast_path_is_on_only_for_decoders_that_concatenate(tokenizer):
    # The fixture's ByteLevel decoder concatenates: add() skips the decode for most ids (the
    # reference test above then runs the fast path); decoders that strip or replace do not.
    assert _concatenates(tokenizer)
    for decoder in (
        decoders.Metaspace(),
        decoders.Sequence([decoders.ByteFallback(), decoders.Strip(" ", 1, 0)]),
        decoders.WordPiece(),
    ):
        other = Tokenizer.from_str(tokenizer.to_str())
        other.decoder = decoder
        assert not _concatenates(other)
    assert not _concatenates(CharTokenizer())  # no description of itself: the general path


def test_long_outputs_trim_the_text_and_still_find_stop_strings():
    # Far past the trimming threshold, a stop string (and one split over the trim point) is
    # still found and cut exactly where the plain definition says.
    text = "".join(chr(97 + (i * 7) % 26) for i in range(9000)) + "STOP" + "tail"
    stop = ["STOP", text[5000:5003] + "#"]  # the second never matches but is often held back
    detok = IncrementalDetokenizer(CharTokenizer(), stop)
    out = "".join(detok.add(ord(c)) for c in text)
    assert detok.stopped_by == "STOP" and out == text[: text.index("STOP")]
    assert len(detok.text) < 3000  # the emitted front was dropped
