"""Continuous batching without a model: the scheduler and block pool driven by a fake executor.
Property-based runs (random arrivals, lengths, cancellations) check the invariants after every
step, that every request finishes and that no block leaks."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedkern.engine.block_pool import BlockPool
from pagedkern.engine.request import Request, RequestStatus
from pagedkern.engine.sampling_params import SamplingParams
from pagedkern.engine.scheduler import RequestRejected, Scheduler, SchedulerConfig


def make_request(i: int, prompt_len: int, max_tokens: int, prefix: list[int] | None = None):
    prompt = (prefix or []) + [(i * 31 + j) % 97 + 3 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def step(scheduler: Scheduler, pool: BlockPool, budget: int) -> list[Request]:
    """One iteration with a fake model: returns the requests that finished."""
    batch = scheduler.schedule()
    assert batch.num_tokens <= budget
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    assert all(n >= 1 for _, n in batch.entries)
    for request, n in batch.entries:  # every scheduled token has a cache slot
        assert len(request.block_table) * pool.block_size >= request.num_computed_tokens + n
    finished = []
    scheduler.on_step_done(batch)
    for request in scheduler.ready(batch):
        request.output_ids.append(len(request.output_ids) % 50)
        if (
            len(request.output_ids) >= request.params.max_tokens
            or request.num_tokens >= scheduler.config.max_model_len
        ):
            scheduler.finish(request)
            finished.append(request)
    pool.check_invariants(scheduler.block_tables())
    return finished


def test_running_decodes_come_first_and_long_prompts_are_chunked():
    pool = BlockPool(64, 4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=256)
    scheduler = Scheduler(pool, config)
    short = make_request(0, 3, 20)
    scheduler.add(short)
    step(scheduler, pool, 10)  # prefill of the short prompt
    long = make_request(1, 25, 5)
    scheduler.add(long)
    chunks = []
    while long.num_computed_tokens < 25:
        batch = scheduler.schedule()
        assert batch.entries[0] == (short, 1)  # the decode goes first
        chunks.append(dict(batch.entries)[long])
        scheduler.on_step_done(batch)
        for r in (short, long):
            if r.num_uncomputed == 0:
                r.output_ids.append(1)
    assert chunks == [9, 9, 7]
    assert long.output_ids == [1]


def test_preemption_takes_the_newest_and_everyone_finishes():
    pool = BlockPool(6, 4)  # 24 token slots for three requests that need up to 16 each
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(pool, config)
    requests = [make_request(i, 6, 10) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    done, preempted = [], []
    for _ in range(200):
        batch_preempted_before = {r.request_id for r in scheduler.waiting}
        done += step(scheduler, pool, 64)
        preempted += [
            r
            for r in scheduler.waiting
            if r.request_id not in batch_preempted_before and r.num_preemptions
        ]
        if not scheduler.has_work:
            break
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert all(len(r.output_ids) == 10 for r in requests)
    assert requests[2].num_preemptions >= 1 and requests[0].num_preemptions == 0
    # The first victim is the newest request, and the oldest is never one.
    assert preempted and preempted[0] is requests[2] and requests[0] not in preempted
    assert pool.num_free == pool.num_blocks


def test_requests_that_can_never_fit_are_rejected_at_once():
    pool = BlockPool(4, 4)
    scheduler = Scheduler(pool, SchedulerConfig(max_model_len=100))
    with pytest.raises(RequestRejected, match="context of 100"):
        scheduler.add(make_request(0, 100, 1))
    with pytest.raises(RequestRejected, match="more KV blocks than the whole cache"):
        scheduler.add(make_request(1, 16, 1))
    scheduler.add(make_request(2, 15, 1))  # 15 + 1 tokens fill the cache exactly


def test_prefix_cache_hits_for_a_shared_system_prompt():
    pool = BlockPool(64, 4)
    scheduler = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=256, max_model_len=256))
    system = list(range(100, 133))  # 33 tokens: 8 full blocks
    first = make_request(0, 5, 10, prefix=system)
    scheduler.add(first)
    step(scheduler, pool, 256)
    second = make_request(1, 7, 2, prefix=system)
    scheduler.add(second)
    step(scheduler, pool, 256)
    assert second.num_cached_tokens == 32
    assert set(second.block_table[:8]) == set(first.block_table[:8])
    assert pool.hit_rate > 0
    while scheduler.has_work:
        step(scheduler, pool, 256)
    assert pool.num_free == pool.num_blocks


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_random_workloads_keep_invariants_and_finish(
    data, num_blocks, block_size, budget, max_seqs, chunked, caching
):
    # without chunks a sequence (or its recompute after a preemption) runs in one step
    max_len = num_blocks * block_size if chunked else min(num_blocks * block_size, budget)
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
    )
    scheduler = Scheduler(pool, config)
    n = data.draw(st.integers(1, 12))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    pending = []
    shared = list(range(500, 500 + 3 * block_size))
    for i, at in enumerate(arrivals):
        prompt_len = data.draw(st.integers(1, max(1, min(max_len - 1, 40))))
        prefix = shared if data.draw(st.booleans()) else None
        request = make_request(i, prompt_len, data.draw(st.integers(1, 12)), prefix)
        pending.append((at, request))
    cancel = {data.draw(st.integers(0, 60)): data.draw(st.integers(0, n - 1)) for _ in range(2)}
    admitted, finished = [], set()
    for t in range(3000):
        while pending and pending[0][0] <= t:
            _, request = pending.pop(0)
            try:
                scheduler.add(request)
                admitted.append(request)
            except RequestRejected:
                assert (
                    request.num_tokens >= max_len
                    or pool.blocks_for(request.num_tokens + 1) > num_blocks
                )
        if t in cancel and cancel[t] < len(admitted) and not admitted[cancel[t]].is_finished:
            scheduler.finish(admitted[cancel[t]])  # cancellation or timeout by the caller
            finished.add(admitted[cancel[t]].request_id)
            pool.check_invariants(scheduler.block_tables())
        finished |= {r.request_id for r in step(scheduler, pool, budget)}
        if not pending and not scheduler.has_work:
            break
    assert all(r.status is RequestStatus.FINISHED for r in admitted)
    assert finished == {r.request_id for r in admitted}
    event(f"preemption: {any(r.num_preemptions for r in admitted)}")
    event(f"prefix hit: {any(r.num_cached_tokens for r in admitted)}")
    assert pool.num_free == pool.num_blocks  # no block leaked
