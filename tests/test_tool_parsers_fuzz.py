"""The tool-call and reasoning parsers over untrusted model text: generated answers (each family's
calls, broken ones, markers, JSON pieces, unicode) cut into random pieces never raise, stream
exactly what the whole answer parses to (after every piece, what a fresh parser fed the text so
far shows), give valid calls, and lose no text but the calls' own. Then one plain case per bug
the fuzzing found, and the work a long answer costs."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkern.serving.tools import REASONING_PARSERS, TOOL_PARSERS, Parsed
from pagedkern.serving.tools.output import ChatOutputParser
from pagedkern.serving.tools.reasoning import CLOSE, OPEN
from pagedkern.serving.tools.spec import NAME, ToolSpecError, check_tools

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", OPEN, CLOSE]
PIECES = [
    *MARKERS, *(m[: len(m) // 2] for m in MARKERS), "{", "}", "[", "]", '"', "\\", ",", ":",
    ";", " ", "\n", "x", "é", "😀", "\u2028", "1", "-", "null", "true", "NaN", "1e999", "[1]",
    '"x"', "<", ">", "[{", '\\"', "\\u00e9", "\\ud800", '{"', '"name": ', '"f"', '"arguments": ',
    '"parameters": ', '{"tool_calls": [', "{}", '{"name": "f", "arguments": {}}',
]  # fmt: skip
GOOD_NAMES = ["f", "get_weather", "a.b-c", "x" * 64]
BAD_NAMES = ["", "a b", "x" * 65, "f\n", "é", "<tool_call>", 7, None]

leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.sampled_from('ab "\\\n{}[]<>/é😀\u2028\x00\ud800'), max_size=6),
)  # fmt: skip
values = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text("ak", max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)
objects = st.dictionaries(st.text('ab"\\é', max_size=3), values, max_size=3)
not_json = st.dictionaries(st.just("x"), st.sampled_from([float("nan"), float("-inf")]), min_size=1)
space = st.sampled_from(["", " ", "\n", "\n\n", "\t "])
soup = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)


@st.composite
def call_json(draw, key: str = "arguments") -> str:
    """One call's JSON: mostly a good one, else broken some way."""
    good = draw(st.integers(0, 9)) < 7
    name = draw(st.sampled_from(GOOD_NAMES if good else GOOD_NAMES + BAD_NAMES))
    args = draw(objects if good else st.one_of(objects, values, not_json))
    if draw(st.integers(0, 5)) == 0:
        args = json.dumps(args)  # arguments as JSON text: read too
    text = json.dumps(
        {"name": name, key: args},
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 1])),
    )
    if not good and draw(st.booleans()):  # cut, or a piece of junk inside
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["", *PIECES]))
    return text


def _named_mistral(draw) -> str:
    name = draw(st.sampled_from(GOOD_NAMES + BAD_NAMES[:4]))
    return f"[TOOL_CALLS]{name}{draw(space)}[ARGS]{json.dumps(draw(objects))}"


@st.composite
def answer(draw, family: str) -> str:
    """An answer in `family`'s format: maybe some text, calls, maybe text or junk after."""
    key = "parameters" if family == "llama3_json" else "arguments"
    calls = draw(st.lists(call_json(key), min_size=1, max_size=3))
    if family == "hermes":
        close = st.sampled_from(["</tool_call>", "</tool_call>", "", "</tool_"])
        body = "\n".join(f"<tool_call>{draw(space)}{c}{draw(space)}{draw(close)}" for c in calls)
    elif family == "llama3_json":
        body = draw(st.sampled_from(["", "<|python_tag|>"])) + "; ".join(calls)
    elif family == "mistral":
        form = draw(st.integers(0, 2))
        if form == 2:
            body = "".join(_named_mistral(draw) for _ in calls)
        else:
            body = ("[TOOL_CALLS]" if form else "") + "[" + ", ".join(calls) + "]"
    else:
        body = '{"tool_calls": [' + ", ".join(calls) + "]}"
    lead = draw(st.sampled_from(["", "", "", " ", "\n", "Sure. ", "1 < 2 "]))
    tail = draw(st.one_of(space, soup))
    return lead + body + tail


def pieces_of(draw, text: str) -> list[str]:
    """`text` cut anywhere: one character at a time, at one point, or at several."""
    mode = draw(st.sampled_from(["each", "one", "some"]))
    if mode == "each":
        return list(text)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=1 if mode == "one" else 12))
    cuts = sorted(set(cuts))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def shown(piece) -> tuple[str, str, list[tuple[str, str]]]:
    return piece.reasoning, piece.content, [(c.name, c.arguments) for c in piece.calls]


def check_stream(make, text: str, pieces: list[str]):
    """The whole answer; asserts the stream of `pieces` shows, after each piece, what a fresh
    parser fed the text so far does, and in the end what the whole answer is."""
    whole = make().parse(text)
    parser, so_far, got = make(), "", ("", "", [])
    for piece in pieces:
        out = shown(parser.feed(piece))
        got = (got[0] + out[0], got[1] + out[1], got[2] + out[2])
        so_far += piece
        assert got == shown(make().feed(so_far)), (text, pieces, so_far)
    out = shown(parser.finish())
    got = (got[0] + out[0], got[1] + out[1], got[2] + out[2])
    assert got == shown(whole), (text, pieces)
    check_calls(whole.calls)
    return whole


def check_calls(calls) -> None:
    """OpenAI's contract: a function name, arguments a JSON object (no NaN, UTF-8 encodable),
    unique ids."""
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert NAME.fullmatch(call.name), call.name
        args = json.loads(call.arguments, parse_constant=lambda c: pytest.fail(c))
        assert isinstance(args, dict)
        call.arguments.encode("utf-8")


def check_text_kept(parser, text: str, content: str, calls) -> None:
    """No text lost but the calls': with none, the content is the text; with some, it is the
    text before the calls (no marker in it) and the text after them, stripped."""
    if not calls:
        assert content == text
        return
    end = text.rstrip()
    for a in range(len(content) + 1):  # (some split of the content fits)
        before, after, b = content[:a], content[a:], len(end) - len(content) + a
        if (
            text.startswith(before)
            and end.endswith(after)
            and b >= a
            and after == after.strip()
            and not any(m in before for m in parser.starts)
            and all(c.name in text[a:b] for c in calls)
        ):
            return
    raise AssertionError((text, content))


def check_thinking_kept(parser, text: str, reasoning: str, content: str) -> None:
    """The thinking is the text after `<think>` (where it opens the answer, or the prompt opened
    it) up to the first `</think>`; the content what follows that, less its leading space."""
    rest = text.lstrip()[len(OPEN) :] if text.lstrip().startswith(OPEN) else None
    if rest is None and not parser.starts_inside:
        assert (reasoning, content) == ("", text)
        return
    rest = text if rest is None else rest
    assert CLOSE not in reasoning and rest.startswith(reasoning)
    after = rest[len(reasoning) :]
    assert (
        after.startswith(CLOSE)
        and after[len(CLOSE) :].lstrip() == content
        or after == content == ""
    )


# --- fuzzing ---------------------------------------------------------------------------------


def check_family(family: str, data, text_source) -> None:
    """A text drawn from text_source, streamed in drawn pieces, parsed as whole; text kept."""
    text = data.draw(text_source)
    whole = check_stream(
        lambda: ChatOutputParser(None, TOOL_PARSERS[family]), text, pieces_of(data.draw, text)
    )
    check_text_kept(TOOL_PARSERS[family], text, whole.content, whole.calls)


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
@FUZZ
@given(data=st.data())
def test_family_answers_stream_as_whole(family, data):
    check_family(family, data, answer(family))


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
@FUZZ
@given(data=st.data())
def test_markup_soup_streams_as_whole(family, data):
    check_family(family, data, soup)


@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
@FUZZ
@given(data=st.data())
def test_thinking_streams_as_whole(reasoning, data):
    head = st.sampled_from(["", " ", "\n", OPEN, f" {OPEN}\n", "<th"])
    tail = st.sampled_from(["", CLOSE, f"{CLOSE}\n\n", "</th", f"{CLOSE} {CLOSE}"])
    text = data.draw(head) + data.draw(soup) + data.draw(tail) + data.draw(soup)
    parser = REASONING_PARSERS[reasoning]
    whole = check_stream(lambda: ChatOutputParser(parser, None), text, pieces_of(data.draw, text))
    check_thinking_kept(parser, text, whole.reasoning, whole.content)


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
@settings(FUZZ, max_examples=50)
@given(data=st.data())
def test_thinking_then_calls_stream_as_whole(reasoning, family, data):
    thinking = (
        data.draw(st.sampled_from(["", OPEN]))
        + data.draw(soup)
        + data.draw(st.sampled_from(["", CLOSE]))
    )
    text = thinking + data.draw(answer(family))
    make = lambda: ChatOutputParser(REASONING_PARSERS[reasoning], TOOL_PARSERS[family])  # noqa: E731
    check_stream(make, text, pieces_of(data.draw, text))


# --- what the fuzzing found: each failed before -----------------------------------------------


def stream_cut_at_every_point(parser, text: str):
    """The whole answer, asserting that every two-piece stream of it shows the same."""
    whole = parser().parse(text)
    for k in range(len(text) + 1):
        p, out = parser(), Parsed()
        for piece in (text[:k], text[k:]):
            out += p.feed(piece)
        out += p.finish()
        assert shown_calls(out) == shown_calls(whole), k
    return whole


def shown_calls(parsed) -> tuple[str, list[tuple[str, str]]]:
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


BAD_G = '<tool_call>{"name": "g", "arguments": [1]}</tool_call>'


@pytest.mark.parametrize(
    "family,text,rest",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n' + BAD_G, BAD_G),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"x"}',
         '<tool_call>{"x"}'),
        ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g"}', '; {"name": "g"}'),
        ("llama3_json", '{"name": "f", "parameters": {}};x', ";x"),
        ("mistral", "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS][1]", "[TOOL_CALLS]g[ARGS][1]"),
    ],
    ids=["hermes-args", "hermes-json", "llama3-name", "llama3-text", "mistral-args"],
)  # fmt: skip
def test_a_bad_call_after_good_ones_keeps_them(family, text, rest):
    """A stream shows a call once complete; a broken one after it cannot take it back. Before,
    the whole answer dropped every call (all of it content) while the stream had shown f."""
    whole = stream_cut_at_every_point(TOOL_PARSERS[family], text)
    assert shown_calls(whole) == (rest, [("f", "{}")])


DIGITS = "1" * 5000  # past Python's int digit limit (a ValueError that is no JSONDecodeError)


@pytest.mark.parametrize(
    "family,text",
    [
        ("hermes", f'<tool_call>{{"name": "f", "arguments": {{"n": {DIGITS}}}}}</tool_call>'),
        ("llama3_json", f'{{"name": "f", "parameters": {{"n": {DIGITS}}}}}'),
        ("mistral", f"[TOOL_CALLS]f[ARGS]{{\"n\": {DIGITS}}}"),
        ("generic", f'{{"tool_calls": [{{"name": "f", "arguments": {{"n": {DIGITS}}}}}]}}'),
    ],
    ids=["hermes", "llama3_json", "mistral", "generic"],
)  # fmt: skip
def test_an_integer_past_the_digit_limit_is_content(family, text):
    """Before: ValueError out of the parser (a 500, or a stream cut off)."""
    for pieces in ([text], [text[:-1], text[-1:]], [text[:4000], text[4000:]]):
        p = TOOL_PARSERS[family]()
        out = p.feed(pieces[0])
        for piece in pieces[1:]:
            out += p.feed(piece)
        out += p.finish()
        assert shown_calls(out) == (text, [])


def test_arguments_with_a_lone_surrogate_escape_can_be_sent():
    """JSON's "\\ud800" decodes to a lone surrogate: written back raw, the stream's UTF-8
    encode raised. Now escaped (still the same JSON value); such a name is no function name."""
    text = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800", "b": "é"}}</tool_call>'
    (call,) = stream_cut_at_every_point(TOOL_PARSERS["hermes"], text).calls
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"a": "\ud800", "b": "é"}
    text = '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'
    assert shown_calls(TOOL_PARSERS["hermes"]().parse(text)) == (text, [])


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_arguments_json_cannot_write_are_content(value):
    """Python's json reads NaN and Infinity (and 1e999 as inf) and wrote them back: arguments
    no JSON parser of a client reads."""
    text = f'<tool_call>{{"name": "f", "arguments": {{"x": {value}}}}}</tool_call>'
    assert shown_calls(stream_cut_at_every_point(TOOL_PARSERS["hermes"], text)) == (text, [])


@pytest.mark.parametrize(
    "family,text",
    [
        ("mistral", "[TOOL_CALLS]Sure, I will look that up[ARGS]{}"),
        ("mistral", "[TOOL_CALLS][TOOL_CALLS]f[ARGS]{}"),
        ("hermes", '<tool_call>{"name": "get weather", "arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f\\n", "arguments": {}}</tool_call>'),
        ("generic", '{"tool_call": {"name": "<tool_call>", "arguments": {}}}'),
    ],
    ids=["mistral-prose", "mistral-marker", "hermes-space", "hermes-newline", "generic-markup"],
)
def test_a_call_needs_a_function_name(family, text):
    """OpenAI's rule (no tool of a request can have another name): before, Mistral's prose
    before [ARGS] or any JSON string was a call's name."""
    assert shown_calls(stream_cut_at_every_point(TOOL_PARSERS[family], text)) == (text, [])


def test_a_tool_name_ending_in_a_newline_is_refused():
    """(`$` matches before a final newline: NAME.match took "f\\n".)"""
    tool = {"type": "function", "function": {"name": "f\n"}}
    with pytest.raises(ToolSpecError, match="function.name"):
        check_tools([tool], 8, 10_000)


# --- the work a long answer costs -------------------------------------------------------------

LONG = 3000


@pytest.mark.parametrize(
    "family,head,tail",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"html": "', '"}}</tool_call>'),
        ("llama3_json", '{"name": "f", "parameters": {"code": "', '"}}'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"code": "', '"}}]'),
        ("generic", '{"tool_calls": [{"name": "f", "arguments": {"code": "', '"}}]}'),
    ],
    ids=["hermes", "llama3_json", "mistral", "generic"],
)
def test_a_long_call_is_parsed_a_bounded_number_of_times(family, head, tail):
    """A call whose arguments hold many closing characters (HTML, code), streamed one
    character at a time, is parsed a few times, not once per `}`, `]` or `>` (each parse reads
    the whole section: quadratic, seconds for 200k characters)."""
    parsed: list[int] = []

    class Counting(TOOL_PARSERS[family]):
        def take_calls(self, section, *rest):
            parsed.append(len(section))
            return super().take_calls(section, *rest)

    text = head + "<p>{a}[b]</p>" * (LONG // 14) + tail
    p, calls = Counting(), []
    for ch in text:
        calls += p.feed(ch).calls
    calls += p.finish().calls
    assert [c.name for c in calls] == ["f"]
    assert len(parsed) <= 8 and sum(parsed) <= 8 * len(text)


@pytest.mark.parametrize("family", ["llama3_json", "mistral", "generic"])
def test_leading_space_is_shown_not_held(family):
    """Space before an answer that may open with a call is content either way: held back, each
    piece re-read all of it (quadratic in a long run of spaces)."""
    p = TOOL_PARSERS[family]()
    assert [p.feed(" ").content for _ in range(3)] == [" "] * 3
    assert p.feed("\n").content == "\n"


@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
def test_space_before_the_thinking_is_held_in_pieces(reasoning):
    """Whose the space before `<think>` is waits on what follows; kept in pieces, not re-read
    and copied with each one (quadratic)."""
    p = REASONING_PARSERS[reasoning]()
    for _ in range(LONG):
        assert p.feed(" ") == p.feed("")
    assert len(p._held) < len(OPEN)
    assert p.feed("<th") == p.feed("")
    out = p.feed("ink>x")
    assert (out.reasoning, out.content) == ("x", "")
