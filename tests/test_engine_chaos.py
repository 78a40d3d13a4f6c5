"""Randomized whole-engine workloads: where the engine's features meet in one run.

Each feature has its own tests (tests/test_engine.py and its neighbours); bugs hide where
they meet: a request aborted mid-prefill while another is preempted, an n > 1 fan-out under a
chunked prompt and a tight KV pool, a stop string inside an accepted speculative run, a token
in flight under async scheduling when the request ends. A seed picks the engine's settings
(async scheduling, n-gram speculation, prefix caching, chunked prefill, a small pool and token
budget) and a workload (arrivals between steps, shared prefixes, every kind of sampling and
stop condition, aborts at every stage); the run is checked after every step and at the end:

- no exception escapes add_request (other than RequestRejected for a prompt the context or the
  pool cannot hold), step() or abort(); abort() returns the ABORT output of a running request
  and None otherwise; the pool's invariants hold after every step; no block is left at the end;
- every request not aborted finishes with a stop, length, context or timeout reason (the run's
  clock counts steps, so timeouts are deterministic); an id's outputs end with its one finished
  output; an aborted request gets nothing after its abort; logprobs come one per token and
  prompt logprobs one per prompt token, for every sample;
- each deterministic request (greedy, or sampled with a seed) that was not aborted gives what
  the same request gives alone in a fresh engine with the same settings: token ids, text and
  finish reason (a prefix where a timeout ended either run).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from pagedkern.engine import Engine, EngineConfig, FinishReason, RequestRejected, SamplingParams
from pagedkern.engine.outputs import RequestOutput
from pagedkern.engine.request import RequestStatus

TINY = "synthetic:tiny"
BLOCK_SIZE = 4
# Two system prompts that many requests share (prefix caching, forks over cached blocks).
PREFIXES = (
    [(7 * j) % 500 + 3 for j in range(40)],
    [(11 * j + 5) % 500 + 3 for j in range(23)],
)
JSON = {"type": "json_object"}
NORMAL_ENDS = {FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTEXT, FinishReason.TIMEOUT}


# --- the workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """A request added between steps: after `step` steps have run."""

    step: int
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class PlannedAbort:
    """When to abort `request_id`: on arrival (before any step), once it is prefilling, once it
    has a token, once it has finished, or `steps` steps after it arrived; `twice`: abort it
    again at the next chance (nothing left to end)."""

    request_id: str
    when: str  # "arrival", "prefilling", "decoding", "finished", "steps"
    steps: int = 0
    twice: bool = False


def engine_from_config(config: dict) -> Engine:
    return Engine.from_config(EngineConfig(**config))


class Driver:
    """How a run feeds the engine and takes its outputs: add_request and step() here. The
    surfaces' fuzzer (test_engine_chaos_surfaces.py) streams, or takes token columns."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add(self, arrival: Arrival, outcome: Outcome) -> None:
        args = dict(prompt_ids=arrival.prompt_ids, params=arrival.params)
        self.engine.add_request(**args, request_id=arrival.request_id)

    def step(self, outcome: Outcome) -> None:
        checked_step(self.engine, outcome)

    def finish(self, outcome: Outcome) -> None:
        outcome.record(self.engine.pop_undelivered())


@dataclass
class Workload:
    config: dict
    arrivals: list[Arrival]
    aborts: list[PlannedAbort]
    # (for models and drivers a config dict cannot name: the surfaces' fuzzer)
    make_engine: Callable[[dict], Engine] = engine_from_config
    driver: Callable[[Engine], Driver] = Driver


def engine_settings(rng: random.Random, backend: str) -> dict:
    """Settings a seed varies: async scheduling or n-gram speculation (refused together),
    prefix caching, chunked prefill, a KV pool small enough to preempt, a small token budget."""
    chunked = rng.random() < 0.8
    config = dict(
        model=TINY,
        backend=backend,
        device="cpu",
        block_size=BLOCK_SIZE,
        # a 150-token prompt and its tokens need up to 46 blocks of 4: a busy engine preempts
        num_blocks=rng.randint(46, 110),
        max_num_seqs=rng.choice([4, 8, 16]),
        # without chunked prefill a whole prompt must fit one step's budget
        max_num_batched_tokens=rng.choice([8, 16, 32, 64]) if chunked else 256,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.7,
    )
    if rng.random() < 0.25:  # a short context: long prompts are refused, others end on it
        config["max_model_len"] = rng.choice([48, 96])
    mode = rng.choice(["plain", "async", "ngram"])
    if mode == "async":
        config["async_scheduling"] = True
    elif mode == "ngram":
        config["speculative"] = "ngram"
        config["num_speculative_tokens"] = rng.randint(1, 5)
    return config


def random_prompt(rng: random.Random) -> tuple[int, ...]:
    """1 to ~150 tokens; half of them start with a shared system prompt, some repeat a motif
    (n-gram speculation finds proposals in them)."""
    length = rng.choice([1, 2, 5, 13, 30, 60, 100, 150])
    prefix = list(rng.choice(PREFIXES)) if rng.random() < 0.5 else []
    if rng.random() < 0.3:
        motif = [rng.randrange(3, 60) for _ in range(rng.randint(1, 5))]
        tail = (motif * length)[:length]
    else:
        tail = [rng.randrange(3, 500) for _ in range(length)]
    return tuple((prefix + tail)[: max(1, min(150, length + len(prefix)))])


def random_params(rng: random.Random, prompt: Sequence[int]) -> SamplingParams:
    """One of the sampling and stop settings the engine supports, mixed."""
    max_tokens = rng.randint(1, 32)
    sampled = rng.random() < 0.5
    kw: dict = dict(
        max_tokens=max_tokens,
        temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
        ignore_eos=rng.random() < 0.7,
    )
    if sampled:
        kw["seed"] = rng.randrange(10_000) if rng.random() < 0.8 else None
        kw["top_p"] = rng.choice([1.0, 0.9])
        kw["top_k"] = rng.choice([0, 40])
    extra = rng.choice(
        ["none", "stop_ids", "stop_strings", "min_tokens", "logprobs", "prompt_logprobs", "json"]
    )
    if extra == "stop_ids":
        kw["stop_token_ids"] = [prompt[-1], rng.randrange(3, 500)]
    elif extra == "stop_strings":
        kw["stop"] = rng.choice([["a"], ["e", "o"], ["xy"]])
    elif extra == "min_tokens":
        kw["min_tokens"] = rng.randint(0, max_tokens)
        kw["stop_token_ids"] = [prompt[-1]]
    elif extra == "logprobs":
        kw["logprobs"] = rng.randint(0, 5)
    elif extra == "prompt_logprobs":
        kw["prompt_logprobs"] = rng.randint(0, 3)
    elif extra == "json":
        kw["response_format"] = JSON
    if rng.random() < 0.35:
        kw["n"] = rng.randint(2, 4)
    if rng.random() < 0.1:  # in steps: the run's clock counts them
        kw["timeout"] = rng.randint(1, 20) + 0.5
    return SamplingParams(**kw)


def random_workload(seed: int, backend: str) -> Workload:
    rng = random.Random(seed)
    config = engine_settings(rng, backend)
    arrivals = []
    for i in range(rng.randint(8, 14)):
        prompt = random_prompt(rng)
        arrivals.append(Arrival(rng.randint(0, 16), f"Q{i}", prompt, random_params(rng, prompt)))
    aborts = []
    for arrival in rng.sample(arrivals, k=len(arrivals) // 2):
        rid = arrival.request_id
        if arrival.params.n > 1 and rng.random() < 0.3:
            rid = f"{rid}.{rng.randint(1, arrival.params.n - 1)}"  # one sample alone
        when = rng.choice(["arrival", "waiting", "prefilling", "decoding", "finished", "steps"])
        aborts.append(PlannedAbort(rid, when, rng.randint(0, 8), twice=rng.random() < 0.3))
    return Workload(config, sorted(arrivals, key=lambda a: a.step), aborts)


# --- running and checking it ---------------------------------------------------------------


@dataclass
class Outcome:
    """What one run gave: every output per request id, and what was aborted when."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    aborted: dict[str, int] = field(default_factory=dict)  # id -> outputs it had at the abort
    rejected: set[str] = field(default_factory=set)

    def record(self, outputs: Sequence[RequestOutput | None]) -> None:
        for out in outputs:
            if out is not None:
                self.outputs.setdefault(out.request_id, []).append(out)

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs.get(request_id, ()) for t in out.token_ids]

    def text(self, request_id: str) -> str:
        return "".join(out.text for out in self.outputs.get(request_id, ()))

    def finish_reason(self, request_id: str) -> FinishReason | None:
        outs = self.outputs.get(request_id)
        return outs[-1].finish_reason if outs and outs[-1].finished else None


def sample_ids(arrival: Arrival) -> list[str]:
    rid = arrival.request_id
    return [rid] + [f"{rid}.{i}" for i in range(1, arrival.params.n)]


def checked_step(engine: Engine, outcome: Outcome) -> None:
    outputs = engine.step()
    engine.pool.check_invariants(engine.scheduler.block_tables())
    for out in outputs:
        assert out.request_id not in outcome.aborted or out.finished, (
            f"{out.request_id}: an output after its abort"
        )
    outcome.record(outputs)


def abort_checked(engine: Engine, outcome: Outcome, request_id: str) -> None:
    """Abort, checking what it returns: the finished ABORT output of a running request, None
    for one that ended or never was."""
    running = request_id in engine.requests
    # an n > 1 request's id ends its samples still running too (their outputs: next step)
    samples = [r for r in engine.requests if r.startswith(request_id + ".")]
    out = engine.abort(request_id)
    engine.pool.check_invariants(engine.scheduler.block_tables())
    if running:
        assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
        assert out.request_id == request_id
    else:
        assert out is None, f"abort of {request_id} (not running) returned {out}"
    for rid in [request_id, *samples]:
        outcome.aborted.setdefault(rid, len(outcome.outputs.get(rid, ())))
    outcome.record([out])


def due(planned: PlannedAbort, engine: Engine, steps_since: int) -> bool:
    """Whether a planned abort's moment has come."""
    rid = planned.request_id
    request = engine.requests.get(rid)
    if planned.when == "steps":
        return steps_since >= planned.steps
    if planned.when == "waiting":  # queued, or preempted
        return request is None or request.status is not RequestStatus.RUNNING
    if planned.when == "prefilling":
        return request is None or 0 < request.num_computed_tokens < len(request.prompt_ids)
    if planned.when == "decoding":
        return request is None or bool(request.output_ids)
    if planned.when == "finished":
        return request is None
    return True


def run_workload(workload: Workload, max_steps: int = 2000) -> tuple[Outcome, Engine]:
    """Run the workload's arrivals and aborts, checking after every step."""
    engine = workload.make_engine(workload.config)
    driver = workload.driver(engine)
    step = 0
    engine.clock = lambda: float(step)  # timeouts in steps: the same every run
    outcome = Outcome()
    pending = list(workload.arrivals)
    arrived_at: dict[str, int] = {}
    aborts = {a.request_id: a for a in workload.aborts}
    repeat: set[str] = set()
    while pending or engine.has_unfinished or aborts or repeat:
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            try:
                driver.add(arrival, outcome)
            except RequestRejected:  # longer than the context or the pool: refused at once
                outcome.rejected.add(arrival.request_id)
                continue
            for rid in sample_ids(arrival):
                arrived_at[rid] = step
        for rid in sorted(repeat):  # the second abort: nothing is left to end
            abort_checked(engine, outcome, rid)
            repeat.discard(rid)
        for rid, planned in list(aborts.items()):
            parent = rid.split(".")[0]
            if parent in outcome.rejected:
                del aborts[rid]
            elif rid in arrived_at and due(planned, engine, step - arrived_at[rid]):
                abort_checked(engine, outcome, rid)
                del aborts[rid]
                if planned.twice:
                    repeat.add(rid)
        if step % 7 == 3:
            abort_checked(engine, outcome, "no-such-request")
        driver.step(outcome)
        step += 1
        assert step < max_steps, "the engine does not finish"
    driver.finish(outcome)
    assert engine.pool.num_free == engine.pool.num_blocks, "blocks leaked"
    assert not engine.has_unfinished
    engine.close()
    return outcome, engine


def check_outputs(workload: Workload, outcome: Outcome) -> None:
    """Per request id: one finished output, the last; a normal finish unless aborted."""
    for arrival in workload.arrivals:
        if arrival.request_id in outcome.rejected:
            continue
        for rid in sample_ids(arrival):
            outs = outcome.outputs.get(rid, [])
            assert outs, f"{rid}: no output"
            finished = [i for i, out in enumerate(outs) if out.finished]
            assert finished == [len(outs) - 1], f"{rid}: finished outputs at {finished}"
            final = outs[-1]
            assert list(final.output_token_ids) == outcome.tokens(rid), f"{rid}: tokens"
            check_logprobs(arrival, rid, outs)
            if rid in outcome.aborted:
                assert len(outs) <= outcome.aborted[rid] + 1, f"{rid}: outputs after its abort"
                assert final.finish_reason is FinishReason.ABORT or (
                    outcome.aborted[rid] == len(outs)  # it had finished before the abort
                ), f"{rid}: {final.finish_reason}"
            else:
                assert final.finish_reason in NORMAL_ENDS, (
                    f"{rid}: {final.finish_reason} ({final.error})"
                )


def check_logprobs(arrival: Arrival, request_id: str, outs: Sequence[RequestOutput]) -> None:
    """logprobs: one per token, of that token. prompt_logprobs: one per prompt token but the
    first, of that token, on every sample's first-token output and its finished one."""
    params = arrival.params
    for out in outs:
        if params.logprobs is not None:
            assert [lp.token_id for lp in out.logprobs] == list(out.token_ids), request_id
            assert all(len(lp.top) == params.logprobs for lp in out.logprobs), request_id
        else:
            assert out.logprobs is None, request_id
    if params.prompt_logprobs is None:
        assert all(out.prompt_logprobs is None for out in outs), request_id
        return
    final = outs[-1]
    if final.finish_reason is FinishReason.ABORT or not final.output_token_ids:
        return  # (ended before its prompt was done: nothing to give)
    table = final.prompt_logprobs
    assert table is not None, f"{request_id}: no prompt logprobs"
    assert table[0] is None
    got = [None if lp is None else lp.token_id for lp in table[1:]]
    assert got == list(arrival.prompt_ids[1:]), f"{request_id}: prompt logprobs {got}"
    assert all(len(lp.top) == params.prompt_logprobs for lp in table[1:]), request_id


def deterministic(params: SamplingParams) -> bool:
    return params.greedy or params.seed is not None


def alone(workload: Workload, arrival: Arrival) -> Outcome:
    """The request alone in a fresh engine with the workload's settings."""
    solo = Arrival(0, arrival.request_id, arrival.prompt_ids, arrival.params)
    return run_workload(dataclasses.replace(workload, arrivals=[solo], aborts=[]))[0]


def check_against_alone(workload: Workload, outcome: Outcome) -> int:
    """Each deterministic request's samples that were not aborted equal the request alone:
    token ids, text and finish reason. Returns how many were compared."""
    compared = 0
    for arrival in workload.arrivals:
        # (a request aborted after it had finished counts: its abort ended nothing)
        rids = [
            r for r in sample_ids(arrival) if outcome.finish_reason(r) is not FinishReason.ABORT
        ]
        if arrival.request_id in outcome.rejected or not rids:
            continue
        if not deterministic(arrival.params):
            continue
        solo = alone(workload, arrival)
        for rid in rids:
            got = (outcome.tokens(rid), outcome.text(rid), outcome.finish_reason(rid))
            want = (solo.tokens(rid), solo.text(rid), solo.finish_reason(rid))
            assert_same_answer(got, want, f"{rid} ({arrival.params}): batched", "alone")
            compared += 1
    return compared


def assert_same_answer(got: tuple, want: tuple, what: str, other: str) -> None:
    """(tokens, text, finish reason) equal; where either timed out (at another step alone, or
    on a clock of its own), the tokens as far as both went."""
    if FinishReason.TIMEOUT in (got[2], want[2]):
        n = min(len(got[0]), len(want[0]))
        got, want = got[0][:n], want[0][:n]
    assert got == want, f"{what} {got} != {other} {want}"


def run_and_check(seed: int, backend: str) -> None:
    workload = random_workload(seed, backend)
    outcome, _ = run_workload(workload)
    check_outputs(workload, outcome)
    check_against_alone(workload, outcome)


# Seeds picked (from sweeps of a few hundred, all passing) so that together they preempt,
# speculate, overlap steps, end requests on a short context and time them out.
REFERENCE_SEEDS = (0, 2, 8, 11, 19, 20)
CPU_SEEDS = (308, 320, 328, 332, 339, 351, 359, 379)


@pytest.mark.parametrize("seed", REFERENCE_SEEDS)
def test_random_workload_on_the_reference_backend(seed: int) -> None:
    run_and_check(seed, "reference")


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_random_workload_on_the_cpu_backend(seed: int) -> None:
    run_and_check(seed, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("backend, num_seeds", [("reference", 20), ("cpu", 40)])
def test_many_random_workloads(backend: str, num_seeds: int) -> None:
    for seed in range(1000, 1000 + num_seeds):
        run_and_check(seed, backend)


# --- regressions the random workloads found ------------------------------------------------


def test_every_sample_of_an_n_request_gets_the_prompt_logprobs() -> None:
    """The further samples of an n > 1 request fork from the first's computed prompt and never
    compute it themselves: they carry the first's prompt logprobs (they had a table of None)."""
    engine = Engine.from_config(
        EngineConfig(model=TINY, backend="reference", num_blocks=64, block_size=BLOCK_SIZE)
    )
    prompt = list(range(3, 13))
    params = SamplingParams(max_tokens=2, temperature=0, n=3, prompt_logprobs=1)
    engine.add_request(prompt_ids=prompt, params=params, request_id="q")
    finals = {}
    while engine.has_unfinished:
        finals |= {out.request_id: out for out in engine.step() if out.finished}
    assert set(finals) == {"q", "q.1", "q.2"}
    first = finals["q"].prompt_logprobs
    assert first[0] is None and [lp.token_id for lp in first[1:]] == prompt[1:]
    for rid in ("q.1", "q.2"):
        assert finals[rid].prompt_logprobs == first, rid


def test_samples_ended_with_their_first_come_out_of_the_same_step() -> None:
    """An n > 1 request that times out mid-prefill ends its samples waiting to fork with it:
    the step returns their outputs too. (They waited for a next step that a caller looping on
    has_unfinished, as the HTTP engine core does, never takes: has_unfinished was False.)"""
    engine = Engine.from_config(
        EngineConfig(
            model=TINY,
            backend="reference",
            num_blocks=64,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=4,
        )
    )
    now = [0.0]
    engine.clock = lambda: now[0]
    params = SamplingParams(n=3, max_tokens=4, timeout=1.0)
    engine.add_request(prompt_ids=list(range(3, 23)), params=params, request_id="q")
    assert not any(out.finished for out in engine.step())  # a chunk of its prompt
    now[0] = 5.0
    ended = {out.request_id: out.finish_reason for out in engine.step()}
    assert ended == {rid: FinishReason.TIMEOUT for rid in ("q", "q.1", "q.2")}
    assert not engine.has_unfinished and engine.pool.num_used == 0
