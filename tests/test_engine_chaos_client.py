"""Randomized workloads through the HTTP front end's engine client (serving/core), against the
offline engine.

test_engine_chaos_surfaces.py drives the engine the way the engine core does (token columns, no
text), one step at a time. Here the whole path runs: EngineClient.in_thread submits each
request to an EngineCore on its own thread, the core steps the engine and sends token-id deltas
and columns, and each RequestStream detokenizes them and matches the stop strings itself
(aborting what one ends). The same seeded workloads (test_engine_chaos_surfaces.surface_workload:
models with sliding layers, draft and n-gram speculation, async scheduling), with their
aborts as handlers that close their stream after some outputs.

Batching now depends on the threads' timing, so the checks are those that hold for every
interleaving: after every step (on the core's thread) the pool's invariants; every stream not
closed ends each of its samples with one finished output, the last, for a normal reason, with
logprobs per token when asked; nothing is left running and no block held once the core has
stopped; and each deterministic request that was not closed gives, token for token and in
text, what the offline engine gives for it alone (its detokenizer and stop strings against the
front end's). Arrivals wait for earlier streams' outputs, never for a time.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
from support.serving import in_thread
from test_engine_chaos import NORMAL_ENDS, Outcome, Workload, alone, assert_same_answer
from test_engine_chaos_surfaces import solo_runs, surface_workload

from pagedkern.engine import LLM, Engine, RequestRejected
from pagedkern.serving.core.request_stream import RequestStream, StreamOutput


@dataclass
class ClientRun:
    """Per request id: its stream's outputs by sample; which streams were closed or refused."""

    outputs: dict[str, dict[int, list[StreamOutput]]]
    closed: set[str]
    rejected: set[str]


def close_points(workload: Workload, rng: random.Random) -> dict[str, int]:
    """After how many outputs each aborted request's handler closes its stream (0: as soon as
    it is admitted); a sample's own abort has no handler of its own: not closed."""
    points = {}
    for planned in workload.aborts:
        if "." not in planned.request_id:
            points[planned.request_id] = 0 if planned.when == "arrival" else rng.randint(1, 6)
    return points


class Handlers:
    """The front end's side of one run: submits the arrivals in order (one waits for the
    previous stream's first output, or not), each read by a handler task until its stream
    ends, or closes it."""

    def __init__(self, engine: Engine, workload: Workload, seed: int) -> None:
        self.rng = random.Random(seed)
        self.workload = workload
        self.closing = close_points(workload, self.rng)
        self.client = in_thread(engine)  # (make_engine's engine checks every step's pool)
        self.run = ClientRun(defaultdict(lambda: defaultdict(list)), set(), set())
        self.tasks: list[asyncio.Task] = []

    async def __call__(self) -> ClientRun:
        self.client.start()
        try:
            await self.submit_all()
            await asyncio.gather(*self.tasks)
        finally:
            await self.client.aclose()
        assert not self.client.core.failed, "the engine core failed"
        return self.run

    async def submit_all(self) -> None:
        previous: asyncio.Event | None = None
        for arrival in self.workload.arrivals:
            if previous is not None and self.rng.random() < 0.5:
                await previous.wait()
            rid = arrival.request_id
            try:
                args = {"prompt_ids": list(arrival.prompt_ids)}
                stream = await self.client.submit(rid, args, arrival.params)
            except RequestRejected:
                self.run.rejected.add(rid)
                continue
            if self.closing.get(rid) == 0:
                self.close(rid, stream)
                continue
            previous = asyncio.Event()
            self.tasks.append(asyncio.create_task(self.handle(rid, stream, previous)))

    async def handle(self, rid: str, stream: RequestStream, seen: asyncio.Event) -> None:
        count = 0
        while batch := await stream.next_batch():
            for out in batch:
                self.run.outputs[rid][out.index].append(out)
            count += len(batch)
            seen.set()
            if count >= self.closing.get(rid, count + 1):
                return self.close(rid, stream)
        seen.set()

    def close(self, rid: str, stream: RequestStream) -> None:
        stream.close()
        self.run.closed.add(rid)


def check_streams(workload: Workload, run: ClientRun) -> None:
    """Every sample of a stream not closed: one finished output, the last, a normal end."""
    for arrival in workload.arrivals:
        rid = arrival.request_id
        if rid in run.rejected or rid in run.closed:
            continue
        assert sorted(run.outputs[rid]) == list(range(arrival.params.n)), f"{rid}: samples"
        for index, outs in run.outputs[rid].items():
            finished = [i for i, out in enumerate(outs) if out.finished]
            assert finished == [len(outs) - 1], f"{rid}/{index}: finished at {finished}"
            assert outs[-1].finish_reason in NORMAL_ENDS, f"{rid}/{index}: {outs[-1]}"
            for out in outs:
                if arrival.params.logprobs is None:
                    assert out.logprobs is None, rid
                else:
                    assert [lp.token_id for lp in out.logprobs] == out.token_ids, rid


def check_against_offline(workload: Workload, run: ClientRun) -> int:
    """Deterministic requests not closed: their samples' token ids, text and finish reason
    are the offline engine's for the request alone (a prefix where a timeout ended one)."""
    compared = 0
    solo_workload = solo_runs(workload)
    for arrival in solo_workload.arrivals:
        rid, params = arrival.request_id, arrival.params
        if rid in run.rejected or rid in run.closed:
            continue
        if not (params.greedy or params.seed is not None):
            continue
        solo: Outcome = alone(solo_workload, arrival)
        for index, outs in run.outputs[rid].items():
            sample = rid if index == 0 else f"{rid}.{index}"
            tokens = [t for out in outs for t in out.token_ids]
            got = (tokens, "".join(out.text for out in outs), outs[-1].finish_reason)
            want = (solo.tokens(sample), solo.text(sample), solo.finish_reason(sample))
            assert_same_answer(got, want, f"{sample} ({params}): client", "offline")
            compared += 1
    return compared


def front_end_workload(seed: int, backend: str) -> Workload:
    """The seed's surfaces with its own arrivals (stop strings too: the front end's) and solo
    runs through step() (timeouts: seconds on the engine's clock here, steps offline: their
    outputs are compared as prefixes)."""
    return surface_workload(seed, backend, front_end=True)


def run_and_check(seed: int, backend: str) -> None:
    workload = front_end_workload(seed, backend)
    engine = workload.make_engine(workload.config)
    run = asyncio.run(Handlers(engine, workload, seed)())
    assert not engine.has_unfinished, "requests left running"
    assert engine.pool.num_free == engine.pool.num_blocks, "blocks leaked"
    check_streams(workload, run)
    check_against_offline(workload, run)


def run_and_check_llm(seed: int, backend: str) -> None:
    """LLM.generate of every arrival at once: each Generation (and each of its samples) ends
    normally with a logprob per token where asked, and a deterministic one is the offline
    engine's for the request alone."""
    workload = front_end_workload(seed, backend)
    llm = LLM.__new__(LLM)  # (over an engine of any model: make_engine's)
    llm.engine = workload.make_engine(workload.config)
    scheduler = llm.engine.scheduler  # (one it refuses would end the whole batch)
    arrivals = [
        a
        for a in workload.arrivals
        if len(a.prompt_ids) < scheduler.config.max_model_len
        and scheduler.tables.blocks_needed(len(a.prompt_ids) + 1) <= scheduler.pool.num_blocks
    ]
    with llm:
        generations = llm.generate(
            [list(a.prompt_ids) for a in arrivals], [a.params for a in arrivals], use_tqdm=False
        )
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks, "blocks leaked"
    run = ClientRun(defaultdict(lambda: defaultdict(list)), set(), set())
    for arrival, generation in zip(arrivals, generations, strict=True):
        samples = generation.samples or (generation,)
        assert len(samples) == arrival.params.n, arrival.request_id
        for index, sample in enumerate(samples):
            logprobs = None if arrival.params.logprobs is None else sample.logprobs
            out = StreamOutput(
                sample.text, list(sample.token_ids), True, sample.finish_reason, index, logprobs
            )
            run.outputs[arrival.request_id][index].append(out)
    rejected = {a.request_id for a in workload.arrivals} - {a.request_id for a in arrivals}
    run.rejected |= rejected
    check_streams(workload, run)
    check_against_offline(workload, run)


@pytest.mark.parametrize("backend, seed", [("reference", 0), ("cpu", 1)])
def test_random_workload_through_the_engine_client(backend: str, seed: int) -> None:
    run_and_check(seed, backend)


@pytest.mark.parametrize("backend, seed", [("reference", 3), ("cpu", 4)])
def test_random_workload_through_llm_generate(backend: str, seed: int) -> None:
    run_and_check_llm(seed, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend, num_seeds", [("reference", 6), ("cpu", 20)])
def test_many_random_workloads_through_the_front_ends(backend: str, num_seeds: int) -> None:
    for seed in range(4000, 4000 + num_seeds):
        run_and_check(seed, backend)
        run_and_check_llm(seed, backend)
