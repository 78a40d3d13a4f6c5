"""An n > 1 request's life under cancellation and limits (CPU, synthetic tiny model): aborting it
at any stage (waiting, prefilling, after its first sample ended) ends exactly its samples and
frees their blocks, every sample holds a seat of max_num_seqs, and under memory pressure the
fan-out, not a short request beside it, gives its blocks back."""

from __future__ import annotations

import pytest
from test_engine import make_engine

from pagedkern.engine import SamplingParams
from pagedkern.engine.request import FinishReason

PROMPT = list(range(3, 13))  # 10 tokens: 2 full blocks of 4 and a partial one


def _step_checked(engine, outputs: dict | None = None):
    outs = engine.step()
    engine.pool.check_invariants(engine.scheduler.block_tables())
    if outputs is not None:
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    return outs


def _drain(engine, outputs: dict | None = None) -> None:
    while engine.has_unfinished:
        _step_checked(engine, outputs)
    assert engine.pool.num_used == 0, "blocks leaked"


def _long(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def test_aborting_an_n_request_while_it_waits_for_a_seat():
    engine = make_engine(max_num_seqs=1)
    engine.add_request(prompt_ids=PROMPT, params=_long(), request_id="busy")
    outputs: dict = {}
    _step_checked(engine, outputs)
    engine.add_request(
        prompt_ids=PROMPT[:7], params=SamplingParams(n=3, max_tokens=5), request_id="fan"
    )
    _step_checked(engine, outputs)
    assert [r.request_id for r in engine.scheduler.waiting] == ["fan"]
    out = engine.abort("fan")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    ended = {o.request_id: o.finish_reason for o in engine.pop_undelivered()}
    assert ended == {"fan.1": FinishReason.ABORT, "fan.2": FinishReason.ABORT}
    assert set(engine.requests) == {"busy"}
    _drain(engine, outputs)
    assert outputs["busy"][-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in outputs["busy"]) == 40


def test_aborting_an_n_request_while_its_prompt_prefills_in_chunks():
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request(prompt_ids=list(range(3, 43)), params=_long(), request_id="other")
    engine.add_request(
        prompt_ids=list(range(50, 90)), params=SamplingParams(n=4, max_tokens=5), request_id="q"
    )
    _step_checked(engine)
    _step_checked(engine)
    leader = engine.requests["q"]
    assert 0 < leader.num_computed_tokens < len(leader.prompt_ids), "still prefilling"
    engine.abort("q")
    assert {o.request_id for o in engine.pop_undelivered()} == {"q.1", "q.2", "q.3"}
    assert set(engine.requests) == {"other"}
    _drain(engine)


def test_a_sample_aborted_before_the_fork_is_not_forked_and_the_rest_run_on():
    engine = make_engine(max_num_batched_tokens=4)
    engine.add_request(
        prompt_ids=PROMPT, params=SamplingParams(n=3, max_tokens=4, ignore_eos=True), request_id="q"
    )
    _step_checked(engine)  # a chunk of the prompt
    assert engine.abort("q.1").finish_reason is FinishReason.ABORT
    outputs: dict = {}
    _drain(engine, outputs)
    assert "q.1" not in outputs
    assert {"q", "q.2"} <= outputs.keys()
    assert all(outputs[r][-1].finish_reason is FinishReason.LENGTH for r in ("q", "q.2"))


def _stop_token_ending_sample_0_first(prompt: list[int]) -> tuple[int, int]:
    """(seed, token): seeded samples equal separately seeded requests, so a token sample 0 draws
    early that the other samples do not draw at all is a stop id ending sample 0 alone."""
    for seed in range(50):
        engine = make_engine()
        params = SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
        engine.add_request(prompt_ids=prompt, params=params, request_id="q")
        outputs: dict = {}
        _drain(engine, outputs)
        ids = {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
        others = set(ids["q.1"]) | set(ids["q.2"])
        for token in ids["q"][1:4]:
            if token not in others and token not in ids["q"][:1]:
                return seed, token
    raise AssertionError("no seed ends sample 0 first")


def test_aborting_an_n_request_after_its_first_sample_ended_ends_the_others():
    seed, stop = _stop_token_ending_sample_0_first(PROMPT)
    engine = make_engine()
    params = SamplingParams(
        n=3, max_tokens=30, temperature=1.0, seed=seed, ignore_eos=True, stop_token_ids=[stop]
    )
    engine.add_request(prompt_ids=PROMPT, params=params, request_id="q")
    first_done = None
    while first_done is None:
        for out in _step_checked(engine):
            if out.request_id == "q" and out.finished:
                first_done = out
    assert first_done.finish_reason is FinishReason.STOP
    assert {"q.1", "q.2"} <= set(engine.requests), "the other samples still run"
    assert engine.abort("q") is None  # sample 0 has ended: nothing of its own to return
    ended = {o.request_id: o.finish_reason for o in engine.pop_undelivered()}
    assert ended == {"q.1": FinishReason.ABORT, "q.2": FinishReason.ABORT}
    assert not engine.has_unfinished and engine.pool.num_used == 0


@pytest.mark.parametrize("n", [8, 32])
def test_every_sample_holds_a_seat_of_max_num_seqs(n):
    engine = make_engine(max_num_seqs=4)
    params = SamplingParams(n=n, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    engine.add_request(prompt_ids=PROMPT, params=params, request_id="q")
    outputs: dict = {}
    most = 0
    while engine.has_unfinished:
        _step_checked(engine, outputs)
        most = max(most, len(engine.scheduler.running))
    assert most == 4
    assert len(outputs) == n
    assert all(sum(len(o.token_ids) for o in outs) == 6 for outs in outputs.values())
    assert engine.pool.num_used == 0


def test_memory_pressure_preempts_the_fan_out_not_the_short_request_beside_it():
    """A 16-sample request fills a small cache as it grows; short requests that arrive while it
    runs are never the ones preempted, and finish long before it."""
    engine = make_engine(num_blocks=48, max_num_seqs=32)
    fan = SamplingParams(n=16, max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request(prompt_ids=PROMPT, params=fan, request_id="fan")
    outputs: dict = {}
    for _ in range(3):
        _step_checked(engine, outputs)
    shorts = []
    for k in range(3):
        rid = f"short{k}"
        engine.add_request(prompt_ids=PROMPT[: 3 + k], params=_long(6), request_id=rid)
        shorts.append(engine.requests[rid])
    done_at = {}
    preempted_fan = 0
    while engine.has_unfinished:
        outs = _step_checked(engine, outputs)
        preempted_fan = max(
            preempted_fan,
            sum(r.num_preemptions for r in engine.requests.values() if r.parent_id == "fan"),
        )
        for out in outs:
            if out.finished:
                done_at[out.request_id] = engine.iteration
    assert preempted_fan > 0, "the cache was too small for the fan-out: it was preempted"
    assert [s.num_preemptions for s in shorts] == [0, 0, 0]
    fan_end = max(v for k, v in done_at.items() if k.startswith("fan"))
    assert all(done_at[s.request_id] < fan_end for s in shorts)
    assert all(outputs[s.request_id][-1].finish_reason is FinishReason.LENGTH for s in shorts)
    assert engine.pool.num_used == 0


def test_a_long_prompt_leaves_half_the_budget_to_a_short_one_waiting():
    """A short prompt that arrives while a long one prefills in chunks is admitted at the next
    step and gets its first token there, not after the long prompt's whole prefill."""
    budget = 64
    engine = make_engine(max_num_batched_tokens=budget)
    engine.add_request(
        prompt_ids=[3 + i % 500 for i in range(600)], params=_long(4), request_id="long"
    )
    _step_checked(engine)
    engine.add_request(prompt_ids=[5, 6], params=_long(2), request_id="short")
    outs = _step_checked(engine)
    assert [o.request_id for o in outs] == ["short"], "its first token at once"
    long_request = engine.requests["long"]
    assert long_request.num_computed_tokens == budget + budget // 2
    _drain(engine)
