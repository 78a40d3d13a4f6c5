"""Engine.stream(): the request is admitted by the call; every sample of an n > 1 request is
streamed, the stream ending when all have finished; closing it cancels what still runs of the
request, also once its first sample has finished, and takes its outputs with it."""

from __future__ import annotations

import gc

import pytest

from pagedkern.engine import Engine, EngineConfig, FinishReason, RequestRejected, SamplingParams

PROMPT = list(range(30, 40))


def make_engine() -> Engine:
    return Engine.from_config(
        EngineConfig(model="synthetic:tiny", backend="reference", num_blocks=128, block_size=4)
    )


def sampled(n: int, max_tokens: int | list[int] = 6) -> SamplingParams:
    return SamplingParams(n=n, seed=3, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)


def test_every_sample_is_streamed_and_equals_step():
    params = sampled(3)
    stepped = make_engine()
    stepped.add_request(prompt_ids=PROMPT, params=params, request_id="r")
    want: dict[str, list[int]] = {}
    for out in stepped.run_until_done():
        want.setdefault(out.request_id, []).extend(out.token_ids)
    engine = make_engine()
    got: dict[str, list[int]] = {}
    finished = []
    for out in engine.stream(prompt_ids=PROMPT, params=params, request_id="r"):
        assert out.request_id not in finished, "an output after its sample's final one"
        got.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            finished.append(out.request_id)
    assert sorted(finished) == ["r", "r.1", "r.2"]
    assert got == want and all(len(ids) == 6 for ids in got.values())
    assert not engine.has_unfinished and not engine.output.undelivered
    assert engine.pool.num_used == 0


def test_the_request_is_admitted_by_the_call():
    engine = make_engine()
    stream = engine.stream(prompt_ids=PROMPT, params=sampled(1), request_id="r")
    assert "r" in engine.requests  # before any next(): an abort finds it
    stream.close()
    with pytest.raises(RequestRejected):
        engine.stream(prompt_ids=[7] * 100_000, params=sampled(1))


@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_a_stream_never_started_cancels_its_request(how):
    """Closed (or collected) before its first next(): every sample is cancelled, its blocks
    and outputs with it."""
    engine = make_engine()
    stream = engine.stream(prompt_ids=PROMPT, params=sampled(2), request_id="q")
    assert set(engine.requests) == {"q", "q.1"}
    if how == "closed":
        stream.close()
    else:
        del stream
        gc.collect()
    assert not engine.requests and not engine.output.undelivered
    assert engine.step() == [] and engine.pool.num_used == 0


def test_a_suspended_stream_does_not_cancel_a_later_request_of_its_id():
    """A chat loop reusing one id: turn 0's stream is left suspended after its final output (a
    `break`); closing it later (as rebinding or collecting it does) must not touch turn 1."""
    engine = make_engine()
    first = engine.stream(prompt_ids=PROMPT, params=sampled(1, 4), request_id="chat")
    want = []
    for out in first:
        want += out.token_ids
        if out.finished:
            break  # (suspended after its final output)
    second = engine.stream(prompt_ids=PROMPT, params=sampled(1, 4), request_id="chat")
    first.close()
    assert "chat" in engine.requests
    got = [t for out in second for t in out.token_ids]
    assert got == want and len(got) == 4  # (the same seed and prompt: the same tokens)
    assert engine.pool.num_used == 0


def test_closing_after_the_first_sample_finished_cancels_the_others():
    """A stop id that sample 0 draws before sample 1 does: sample 0 finishes first; closing the
    stream then ends sample 1 too, and nothing of the request is left for step()."""
    free = make_engine()
    free.add_request(prompt_ids=PROMPT, params=sampled(2, 40), request_id="r")
    made: dict[str, list[int]] = {}
    for out in free.run_until_done():
        made.setdefault(out.request_id, []).extend(out.token_ids)
    first, second = made["r"], made["r.1"]
    cut = next(i for i in range(1, 30) if first[i] not in second[: i + 2])
    params = SamplingParams(
        n=2, seed=3, temperature=1.0, max_tokens=40, ignore_eos=True, stop_token_ids=[first[cut]]
    )
    engine = make_engine()
    other = engine.add_request(prompt_ids=[5, 6, 7], params=sampled(1, 40), request_id="o")
    stream = engine.stream(prompt_ids=PROMPT, params=params, request_id="r")
    for out in stream:
        if out.finished:
            assert out.request_id == "r" and out.finish_reason is FinishReason.STOP
            break
    assert "r.1" in engine.requests
    stream.close()
    assert "r.1" not in engine.requests
    # what the closed stream set aside or ended goes with it; the other request's stays
    assert all(o.request_id == "o" for o in engine.output.undelivered)
    rest = list(engine.run_until_done())
    assert {o.request_id for o in rest} == {"o"}
    assert rest[-1].finished and len(other.output_ids) == 40
    assert engine.pool.num_used == 0


def test_an_abort_from_elsewhere_ends_the_stream():
    engine = make_engine()
    stream = engine.stream(prompt_ids=PROMPT, params=sampled(2, 40), request_id="r")
    first = next(stream)
    assert first.request_id in ("r", "r.1") and not first.finished
    assert engine.abort("r").finish_reason is FinishReason.ABORT
    rest = list(stream)  # what the stream held of the other sample, its ABORT, the end
    assert {o.request_id for o in rest} == {"r.1"}
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert engine.pool.num_used == 0
