"""The host's hot paths keep the general code's behaviour: the scheduler's one loop over the
running requests (plain decodes and everything else) keeps its policy on random arrivals, and
the one append path (OutputProcessor.append) makes the same outputs with a tracer attached
(which adds the per-token trace calls) as without, stop by stop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.block_pool import BlockPool
from pagedkern.engine.request import Request
from pagedkern.engine.scheduler import Scheduler, SchedulerConfig


@settings(max_examples=40, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 13), st.integers(1, 25)),
        min_size=1,
        max_size=10,
    ),
    num_blocks=st.integers(12, 40),
    caching=st.booleans(),
    budget=st.integers(4, 24),
)
def test_schedule_policy_on_random_arrivals(arrivals, num_blocks, caching, budget):
    """Random arrivals into a small pool (preemption) with a small budget (chunked prefill,
    decodes cut off by the budget), step by step: the running requests are scheduled in order,
    a decode for one token; one left out (not preempted) only once the budget is spent; the
    pool's counts hold; everyone finishes."""
    config = SchedulerConfig(max_model_len=200, max_num_seqs=6, max_num_batched_tokens=budget)
    scheduler = Scheduler(BlockPool(num_blocks, 4, caching), config)
    pending = sorted(arrivals)
    for step in range(300):
        while pending and pending[0][0] <= step:
            _, prompt_len, max_tokens = pending.pop(0)
            i = len(arrivals) - len(pending)
            prompt = [(i * 7 + j) % 5 + 3 for j in range(prompt_len)]  # shared prefixes
            params = SamplingParams(max_tokens=max_tokens, temperature=0)
            scheduler.add(Request(f"r{i}", prompt, params))
        if not (pending or scheduler.has_work):
            return
        running = list(scheduler.running)
        uncomputed = {r.request_id: r.num_uncomputed for r in running}
        batch = scheduler.schedule()
        scheduled = {r.request_id: n for r, n in batch.entries}
        preempted = {r.request_id for r in batch.preempted}
        assert batch.num_tokens <= budget and len(scheduler.running) <= 6, step
        assert not preempted & scheduled.keys(), step
        order = [r.request_id for r in running if r.request_id in scheduled]
        assert [r.request_id for r, _ in batch.entries][: len(order)] == order, step
        for request in running:
            rid = request.request_id
            if rid in scheduled:
                assert 1 <= scheduled[rid] <= uncomputed[rid], step
            elif rid not in preempted:
                assert batch.num_tokens == budget, (step, rid)
        scheduler.on_step_done(batch)
        for request in scheduler.ready(batch):
            request.output_ids.append(len(request.output_ids) % 3 + 3)
            if len(request.output_ids) >= request.params.max_tokens:
                scheduler.finish(request)
        scheduler.pool.check_invariants(scheduler.block_tables())
    pytest.fail("the requests did not finish in 300 steps")


class NullTracer:
    """A tracer that records nothing: the append path's per-token trace calls run."""

    def request_added(self, request) -> None: ...
    def iteration(self, number, batch, pool) -> None: ...
    def candidates(self, request, logits, token, tokenizer) -> None: ...
    def token(self, request, token, text) -> None: ...
    def speculated(self, request, proposed, accepted, slots_rewound, blocks_freed) -> None: ...
    def finished(self, request, text, freed, pool) -> None: ...


VARIED = [
    SamplingParams(max_tokens=12, temperature=1.0, seed=1),
    SamplingParams(max_tokens=30, temperature=1.0, seed=2, stop_token_ids=[315, 212]),
    SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop=["hh", "il"]),
    SamplingParams(max_tokens=30, temperature=1.0, seed=4, stop=["hh"], min_tokens=5),
    SamplingParams(max_tokens=30, temperature=1.0, seed=5, repetition_penalty=1.3),
    SamplingParams(max_tokens=9, temperature=1.0, seed=6, logprobs=2),
    SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),  # the context ends it
    SamplingParams(max_tokens=7, temperature=1.0, seed=8, n=2),
    SamplingParams(max_tokens=1, temperature=0),
]


def run_varied(tracer: NullTracer | None, detokenize: bool) -> dict[str, list[tuple]]:
    config = EngineConfig(
        model="synthetic:tiny", backend="reference", num_blocks=64, block_size=4, max_model_len=48
    )
    engine = Engine.from_config(config, tracer=tracer)
    engine.detokenize = detokenize
    for i, params in enumerate(VARIED * 2):
        if params.stop and not detokenize:
            params = SamplingParams(max_tokens=params.max_tokens, temperature=0, seed=i)
        prompt = [(i * 13 + j) % 400 + 5 for j in range(5 + 3 * i % 36)]
        engine.add_request(prompt_ids=prompt, params=params, request_id=f"q{i}")
    got: dict[str, list[tuple]] = {}
    for out in engine.run_until_done():
        m = out.metrics
        got.setdefault(out.request_id, []).append(
            (out.token_ids, out.text, out.finished, out.finish_reason, out.logprobs)
            + (out.output_token_ids, m.num_output_tokens, m.finish_time is None, out.error)
        )
    assert not engine.requests and engine.pool.num_used == 0
    return got


@pytest.mark.parametrize("detokenize", [True, False], ids=["detokenize", "ids-only"])
def test_a_tracer_changes_no_output(detokenize):
    fast, general = run_varied(None, detokenize), run_varied(NullTracer(), detokenize)
    assert fast == general
    reasons = {steps[-1][3].value for steps in fast.values()}
    assert {"length", "context_length"} <= reasons  # the stops the fast lane checks inline
    if detokenize:
        assert "stop" in reasons and any(step[1] for steps in fast.values() for step in steps)
