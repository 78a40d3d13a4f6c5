"""Asynchronous scheduling (engine/overlap.py) under forced interleavings, on the CPU: the
orderings a GPU produces by itself (the worker's step still running, or already past the next
one, while the engine thread moves on) forced with events, never with timing.

- A slow engine thread: the worker runs step N+1 before the engine thread completes step N.
  The logits a tracer reads for step N must still be step N's (a replay's static output is
  overwritten by the next step; piecewise graphs keep one on the CPU too).
- A slow worker whose host-to-device copies read their sources late: step N's host inputs must
  be unchanged when N runs, after the engine thread prepared N+1 (what a non_blocking copy from
  pinned memory needs).
- Which steps run: from the same prefix-cache state, synchronous and overlapped scheduling run
  the same steps (token for token equality on batch-dependent GPU kernels needs that); a second
  run of the same prompts on a warm cache runs different steps, with or without overlap."""

from __future__ import annotations

import random
import threading
from concurrent.futures import wait

import numpy as np
import pytest

from pagedkern.engine import Engine, EngineConfig, SamplingParams


def make_engine(overlap: bool, tracer=None, **overrides) -> Engine:
    config = dict(
        model="synthetic:tiny",
        backend="reference",
        device="cpu",
        num_blocks=512,
        block_size=4,
        max_num_seqs=32,
        max_num_batched_tokens=16,  # chunked prefill: mixed steps one after another
        cuda_graphs=True,  # the static-buffer paths (decode graphs, piecewise mixed steps)
        async_scheduling=overlap,
    )
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config), tracer)


def prompts(n: int = 10) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def run(engine: Engine, params: list[SamplingParams] | SamplingParams) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts()):
        p = params[i] if isinstance(params, list) else params
        engine.add_request(prompt_ids=ids, params=p, request_id=f"Q{i}")
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.pool.num_used == 0
    return out


class LogitsTracer:
    """Records each traced (request, logits row, token); the other hooks do nothing."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, np.ndarray, int]] = []

    def candidates(self, request, logits, token, tokenizer) -> None:
        self.rows.append((request.request_id, logits.float().numpy().copy(), token))

    def request_added(self, request) -> None: ...

    def iteration(self, number, batch, pool) -> None: ...

    def token(self, request, token, text) -> None: ...

    def speculated(self, request, proposed, accepted, slots_rewound, blocks_freed) -> None: ...

    def finished(self, request, text, freed, pool) -> None: ...


def slow_engine_thread(engine: Engine) -> list[int]:
    """Make the engine thread complete step N only once the worker has run step N+1 (where
    one was launched); returns a list counting the completions that waited so."""
    overlap, complete, waited = engine.overlap, engine.overlap.complete, []

    def late(step):
        later = overlap.in_flight
        if later is not None and later is not step:
            wait([later.future])
            waited.append(1)
        return complete(step)

    overlap.complete = late
    return waited


def test_traced_logits_are_the_steps_own_when_the_next_step_ran_first():
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sync_tracer, tracer = LogitsTracer(), LogitsTracer()
    sync = make_engine(False, sync_tracer)
    want = run(sync, greedy)
    engine = make_engine(True, tracer)
    waited = slow_engine_thread(engine)
    got = run(engine, greedy)
    engine.close()
    assert engine.runner.piecewise is not None and waited, "the ordering was not forced"
    assert got == want
    # greedy: each traced row's argmax is the token drawn from it, and the rows equal the
    # synchronous run's (each request's rows in its own order)
    for rid, row, token in tracer.rows:
        assert int(row.argmax()) == token, f"{rid}: traced logits of another step"
    mine, theirs = {}, {}
    for rows, into in ((tracer.rows, mine), (sync_tracer.rows, theirs)):
        for rid, row, token in rows:
            into.setdefault(rid, []).append((token, row))
    assert mine.keys() == theirs.keys()
    for rid in mine:
        assert [t for t, _ in mine[rid]] == [t for t, _ in theirs[rid]], rid
        for (_, a), (_, b) in zip(mine[rid], theirs[rid], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=rid)


def late_reading_copies(engine: Engine) -> list[int]:
    """A worker whose copies read their sources late: step k starts only once the engine
    thread has launched step k+1 or waits for step k, then checks that k's host inputs (the
    packed layout, the sampling columns) still hold what `prepare` made. Returns the number of
    steps checked."""
    runner, overlap = engine.runner, engine.overlap
    prepare, execute = runner.prepare, runner.execute
    launch, complete = overlap.launch, overlap.complete
    cond = threading.Condition()
    state = {"launched": 0, "waiting": set()}
    snapshots: dict[int, tuple] = {}
    checked: list[int] = []  # step numbers checked; -1: a step whose inputs had changed

    def host_inputs(step) -> tuple:
        sampling = () if step.sampling is None else step.sampling.fields
        return (step.layout.pack().numpy(), *sampling)

    def prepared(*args, **kwargs):
        step = prepare(*args, **kwargs)
        snapshots[id(step)] = tuple(a.copy() for a in host_inputs(step))
        return step

    def launched(batch, previous, own_logits=False):
        in_flight = launch(batch, previous, own_logits)
        if in_flight is None:
            return None
        with cond:
            in_flight.future.number = state["launched"]
            state["launched"] += 1
            cond.notify_all()
        return in_flight

    def completing(step):
        with cond:
            state["waiting"].add(getattr(step.future, "number", -1))
            cond.notify_all()
        return complete(step)

    numbers = iter(range(1 << 30))

    def executed(step, previous=None):
        if threading.current_thread() is threading.main_thread():
            return execute(step, previous)  # a synchronous step: nothing in flight
        k = next(numbers)  # the worker runs launched steps in launch order
        with cond:
            cond.wait_for(lambda: state["launched"] > k + 1 or k in state["waiting"])
        now, before = host_inputs(step), snapshots.pop(id(step))
        same = len(now) == len(before) and all(map(np.array_equal, now, before))
        checked.append(k if same else -1)
        return execute(step, previous)

    runner.prepare, runner.execute = prepared, executed
    overlap.launch, overlap.complete = launched, completing
    return checked


@pytest.mark.parametrize("graphs", [True, False], ids=["static-buffer paths", "eager"])
def test_host_inputs_hold_until_a_late_copy_reads_them(graphs):
    """Seeded sampling with a seed per request and staggered lengths: rows leave the
    persistent batch while steps are in flight (its columns are gathered in place)."""
    params = [
        SamplingParams(max_tokens=3 + i % 5, temperature=0.8, top_k=20, seed=i, ignore_eos=True)
        for i in range(10)
    ]
    want = run(make_engine(False, cuda_graphs=graphs), params)
    engine = make_engine(True, cuda_graphs=graphs, max_num_batched_tokens=64)
    checked = late_reading_copies(engine)
    got = run(engine, params)
    engine.close()
    assert -1 not in checked, "a host input changed before the late copy read it"
    assert got == want
    assert len(checked) >= 8 and engine.overlap.num_overlapped > 0


def step_shapes(engine: Engine) -> list[tuple]:
    """Record each executed step as (tokens, sequences, prefills, logit rows)."""
    execute, shapes = engine.runner.execute, []

    def recorded(step, previous=None):
        layout = step.layout
        shapes.append(
            (
                len(layout.input_ids),
                len(layout.seq_lens),
                layout.num_prefills,
                len(layout.logits_indices),
            )
        )
        return execute(step, previous)

    engine.runner.execute = recorded
    return shapes


def test_same_cache_state_same_steps_and_a_warm_cache_changes_them():
    """What token-for-token equality on a GPU needs: its kernels' rounding depends on the
    batch (cuBLAS picks by M, the attention split plan by batch size), so only runs of the
    same steps can be compared. Overlap changes no step; a warm prefix cache does."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sync = make_engine(False, max_num_batched_tokens=64)
    sync_steps = step_shapes(sync)
    want = run(sync, greedy)
    overlapped = make_engine(True, max_num_batched_tokens=64)
    overlapped_steps = step_shapes(overlapped)
    got = run(overlapped, greedy)
    assert got == want and overlapped_steps == sync_steps
    assert overlapped.overlap.num_overlapped > 0
    # the same prompts again on the warm engine (as a second timed run would): other steps
    del overlapped_steps[:]
    again = run(overlapped, greedy)
    overlapped.close()
    assert again == want  # fp32 on the CPU: the same tokens all the same
    assert overlapped_steps != sync_steps
    assert sum(s[0] for s in overlapped_steps) < sum(s[0] for s in sync_steps)
