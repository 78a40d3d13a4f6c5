"""The HTTP server's engine core runs its Engine with detokenization off (`Engine.detokenize`):
the same tokens, finish reasons and blocks as a detokenizing engine, no text, and stop strings
(which would need text) refused; its plain decode tokens as two columns (`Engine.token_deltas`)
that say what the outputs would have; and the front end's delivery of a request's outputs in batches
(RequestStream.put / batches, one SSE write per batch)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_http_server import tiny_engine

from pagedkern.engine import FinishReason, SamplingParams
from pagedkern.engine.outputs import TokenDeltas
from pagedkern.serving.core.client_errors import EngineUnavailable
from pagedkern.serving.core.engine_client import EngineClient
from pagedkern.serving.core.engine_core import EngineCore
from pagedkern.serving.core.messages import Abort, SampleDelta
from pagedkern.serving.core.metrics import ServerMetrics
from pagedkern.serving.core.request_stream import RequestStream, StreamOutput
from pagedkern.serving.http.body_formats import CompletionFormat
from pagedkern.serving.http.streaming import sse_events

PROMPTS = ["tell me", "a much longer prompt about rivers, cities and music", "x"]


def run(detokenize: bool) -> dict:
    engine = tiny_engine()
    engine.detokenize = detokenize
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            seed=i, temperature=1.0, max_tokens=9 + i, n=2 if i == 1 else 1, min_tokens=i
        )
        engine.add_request(prompt, params, request_id=f"r{i}")
    got: dict = {}
    for out in engine.run_until_done():
        ids, text, reason = got.get(out.request_id, ((), "", None))
        got[out.request_id] = (ids + out.token_ids, text + out.text, out.finish_reason)
    assert engine.pool.num_used == 0
    return got


def test_without_detokenization_the_engine_makes_the_same_tokens_and_no_text():
    with_text, ids_only = run(True), run(False)
    assert {k: (v[0], v[2]) for k, v in ids_only.items()} == {
        k: (v[0], v[2]) for k, v in with_text.items()
    }
    assert all(text for _, text, _ in with_text.values())  # (the comparison means something)
    assert all(text == "" for _, text, _ in ids_only.values())


def test_without_detokenization_stop_strings_are_refused():
    engine = tiny_engine()
    engine.detokenize = False
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("hi", SamplingParams(stop=["zz"]))
    assert not engine.has_unfinished


def test_the_engine_core_turns_detokenization_off():
    engine = tiny_engine()
    EngineCore(engine, channel=None)
    assert engine.detokenize is False
    assert engine.token_deltas is not None


def test_a_first_sample_alone_abort_leaves_a_compiling_request_waiting():
    """Abort(alone) ends a first sample, so it can only follow that sample's tokens; one for a
    request whose grammar still compiles (from a broken front end) must not drop the whole
    request, as a plain Abort does."""
    core = EngineCore(tiny_engine(), channel=None)
    core._compiling["r"] = (None, [1, 2], SamplingParams(n=2))
    core._abort(Abort("r", True))
    assert "r" in core._compiling
    core._abort(Abort("r"))
    assert "r" not in core._compiling and core._outputs == []


CORE_PARAMS = [
    SamplingParams(seed=1, temperature=1.0, max_tokens=14),
    SamplingParams(seed=2, temperature=1.0, max_tokens=9, n=2),
    SamplingParams(seed=3, temperature=1.0, max_tokens=8, logprobs=2),
    SamplingParams(seed=4, temperature=1.0, max_tokens=11, repetition_penalty=1.3),
    SamplingParams(seed=5, temperature=0.0, max_tokens=6, prompt_logprobs=1),
    SamplingParams(seed=6, temperature=1.0, max_tokens=1),
]


def core_deltas(columns: bool, async_scheduling: bool = False) -> tuple[dict, int]:
    """What the core would send per (key, sample index), step by step, as [token ids, finish,
    error, logprobs, prompt]; with `columns`, the two-column tokens are folded back in."""
    # (max_num_seqs 4: some wait, so steps mix prefill and decode)
    engine = tiny_engine(max_num_seqs=4, async_scheduling=async_scheduling)
    engine.detokenize = False
    if columns:
        engine.token_deltas = TokenDeltas()
    for i, params in enumerate(CORE_PARAMS * 2):
        engine.add_request(PROMPTS[i % 3], params, request_id=f"r{i}")
    got: dict = {}
    num_columns = 0
    while engine.has_unfinished:
        rows = [SampleDelta.of(out).to_wire() for out in engine.step()]
        keys, tokens = engine.token_deltas.take() if columns else ([], [])
        assert not set(keys) & {row[0] for row in rows}  # one part per request and step
        num_columns += len(keys)
        for key, token in zip(keys, tokens, strict=True):
            got.setdefault((key, 0), []).append([[token], None, None, None, None])
        for key, index, ids, finish, error, logprobs, prompt in rows:
            got.setdefault((key, index), []).append([list(ids), finish, error, logprobs, prompt])
    assert engine.pool.num_used == 0
    return got, num_columns


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlap"])
def test_token_columns_carry_what_the_outputs_would_have(async_scheduling):
    """The core's two columns (Engine.token_deltas) hold exactly the deltas that would have
    been plain outputs: folded back in, every request's deltas are the same, step by step;
    logprobs, prompt logprobs, n > 1 samples, first tokens and finishes stay outputs. With
    asynchronous scheduling too (a step's tokens are appended one step later)."""
    with_columns, num_columns = core_deltas(True, async_scheduling)
    assert with_columns == core_deltas(False, async_scheduling)[0]
    assert num_columns > 40  # most decode tokens went through the columns
    for (key, _), deltas in with_columns.items():
        i = int(key[1:])
        params = CORE_PARAMS[i % len(CORE_PARAMS)]
        assert deltas[-1][1] is not None  # every sample's last delta finishes it
        if params.logprobs is not None:
            assert all(d[3] for d in deltas)


class _Recorder:
    """An EngineClient's side of a RequestStream: real metrics (EngineClient.record), aborts
    noted."""

    record = EngineClient.record

    def __init__(self) -> None:
        self.metrics, self.aborts = ServerMetrics(), []

    def abort(self, request_id: str, alone: bool) -> None:
        self.aborts.append(request_id if not alone else (request_id, "alone"))


def test_a_column_token_makes_what_take_makes():
    """RequestStream.take_token (a frame's column lane) against take() on the same tokens: the
    same StreamOutputs up to and including a stop string's cut, the same abort, the same
    metrics (tokens, inter-token latencies) once the frame's latencies are recorded."""
    tokenizer = tiny_engine().tokenizer
    ids = tokenizer.encode("a much longer prompt about rivers, cities and music")
    params = SamplingParams(stop=["cities"])
    runs = []
    for columns in (False, True):
        owner = _Recorder()
        s = RequestStream(
            "r", params, frozenset(), tokenizer, abort=owner.abort, record=owner.record
        )
        outs = [s.take(SampleDelta("r", 0, [ids[0]], None, None, None), 0.0)]  # a row
        for i, token in enumerate(ids[1:], 1):
            if columns:
                itls: list[float] = []
                outs.append(s.take_token(token, 0.5 * i, itls))
                owner.metrics.later_tokens(itls)
            else:
                outs.append(s.take(SampleDelta("r", 0, [token], None, None, None), 0.5 * i))
        m = owner.metrics
        runs.append((outs, owner.aborts, m.generation_tokens, m.itl.counts, m.itl.sum, m.finished))
    assert runs[0] == runs[1]
    outs = runs[0][0]
    assert any(o is None for o in outs) and outs[outs.index(None) - 1].finished  # cut, then none
    assert runs[0][1] == ["r"] and runs[0][5] == {"stop": 1}


class _Owner:
    """What a RequestStream needs of its EngineClient when nothing is aborted or recorded."""

    def abort(self, request_id: str) -> None:
        raise AssertionError(f"nothing should be aborted ({request_id})")

    def record(self, *args) -> None:
        pass


def stream(n: int = 1) -> RequestStream:
    engine = tiny_engine()
    owner = _Owner()
    return RequestStream(
        "r", SamplingParams(n=n), frozenset(), engine.tokenizer, owner.abort, owner.record
    )


def outputs(texts: list[str]) -> list[StreamOutput]:
    last = len(texts) - 1
    return [
        StreamOutput(t, [5], i == last, FinishReason.LENGTH if i == last else None)
        for i, t in enumerate(texts)
    ]


async def read_all(s: RequestStream) -> list[list[str]]:
    return [[out.text for out in batch] async for batch in s.batches()]


def test_outputs_that_arrive_together_are_read_together():
    async def scenario() -> list[list[str]]:
        s = stream()
        first, *rest = outputs(["a", "b", "c", "d"])
        reader = asyncio.ensure_future(read_all(s))
        s.put(first)
        await asyncio.sleep(0)  # the reader takes "a" alone
        await asyncio.sleep(0)
        for out in rest:  # three more before the reader runs again
            s.put(out)
        return await reader

    assert asyncio.run(scenario()) == [["a"], ["b", "c", "d"]]


def test_a_failure_ends_the_batches_after_what_came_before_it():
    async def scenario() -> tuple[list[str], BaseException | None]:
        s = stream()
        s.put(outputs(["a", "b"])[0])
        s.put(EngineUnavailable("gone"))
        seen, failure = [], None
        try:
            async for batch in s.batches():
                seen += [out.text for out in batch]
        except EngineUnavailable as exc:
            failure = exc
        return seen, failure

    seen, failure = asyncio.run(scenario())
    assert seen == ["a"] and isinstance(failure, EngineUnavailable)


def test_one_batch_is_one_piece_of_the_event_stream_with_one_event_per_output():
    async def scenario() -> list[str]:
        s = stream()
        for out in outputs(["a", "b", "c"]):
            s.put(out)
        fmt = CompletionFormat("cmpl-1", "m", include_usage=False)
        return [piece async for piece in sse_events([s], fmt)]

    pieces = asyncio.run(scenario())
    assert len(pieces) == 2 and pieces[1] == "data: [DONE]\n\n"
    events = pieces[0].split("\n\n")[:-1]
    assert [e.split('"text":')[1].split(",")[0] for e in events] == ['"a"', '"b"', '"c"']
    assert '"finish_reason":"length"' in events[2] and '"finish_reason":null' in events[0]


class FakeChunkWriter:
    """A connection's ChunkedBodyCycle as the direct path sees it."""

    def __init__(self):
        self.ready, self.chunks = True, []

    def chunk_ready(self) -> bool:
        return self.ready

    def write_chunk(self, body: bytes) -> None:
        self.chunks.append(body.decode())


def texts_of(pieces: list[str]) -> list[str]:
    """The texts of the chunk events in pieces of an event stream."""
    events = [e[len("data: ") :] for e in "".join(pieces).split("\n\n") if e]
    return [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]


def test_outputs_go_straight_to_the_connection_in_order_with_the_handler_after_a_stall():
    """With a chunk writer, an unfinished output is written by put() itself; while the writer
    cannot take it (flow control) or the handler still has a piece on its way, outputs queue
    for the handler, and nothing overtakes what is queued; the end always goes through the
    handler."""

    async def scenario() -> tuple[list[str], list[str]]:
        s, writer = stream(), FakeChunkWriter()
        fmt = CompletionFormat("cmpl-1", "m", include_usage=False)
        body = sse_events([s], fmt, writer)
        pieces, resume = [], asyncio.Event()

        async def respond() -> None:  # the response's send loop, stalled after its 1st piece
            async for piece in body:
                pieces.append(piece)
                if len(pieces) == 1:
                    await resume.wait()

        responding = asyncio.ensure_future(respond())
        await asyncio.sleep(0)  # the body runs up to its first wait: the sink is set
        a, b, c, d, e = outputs(["a", "b", "c", "d", "e"])
        s.put(a)  # written at once
        writer.ready = False
        s.put(b)  # the connection is paused: for the handler
        await asyncio.sleep(0)  # the handler takes b, its send stalls
        writer.ready = True
        s.put(c)  # b is still on its way: c must wait behind it
        resume.set()
        await asyncio.sleep(0)
        s.put(d)
        s.put(e)  # the last one: through the handler
        await responding
        return writer.chunks, pieces

    chunks, pieces = asyncio.run(scenario())
    assert texts_of(chunks) == ["a", "d"]  # (written when nothing was queued or on its way)
    assert texts_of(pieces) == ["b", "c", "e"]
    assert pieces[-1] == "data: [DONE]\n\n" and '"finish_reason":"length"' in pieces[-2]


def test_a_failing_direct_write_leaves_the_output_to_the_handler():
    """A sink that raises is dropped (logged); the output is queued for the handler, so the
    frame handler, which writes for every stream, never sees the exception."""

    def broken(item) -> bool:
        raise RuntimeError("write failed")

    s = stream()
    s.sink = broken
    a, b = outputs(["a", "b"])
    s.put(a)
    s.put(b)
    assert s.sink is None

    async def read() -> list[str]:
        return [out.text for out in await s.next_batch()]

    assert asyncio.run(read()) == ["a", "b"]
