"""Randomized whole-engine workloads over the surfaces test_engine_chaos.py leaves out.

The same workloads (arrivals, aborts, every kind of sampling and stop) and the same checks
(after every step: the pool's invariants; at the end: one finished output per id, the last,
logprobs, no leaked block; deterministic requests equal to the request alone), run where the
engine's other features meet:

- how outputs are taken: Engine.stream() generators (advanced one output at a time in a seeded
  order beside direct step() calls, a few closed early: the consumer gone), or the HTTP engine
  core's way (no detokenization, plain decode tokens as outputs.TokenDeltas columns; the whole
  client and LLM.generate: test_engine_chaos_client.py);
- draft-model speculation: a different random model of the vocabulary (few acceptances: the
  rollbacks) or the target's own first layer (self:1; many);
- models with sliding-window layers: hybrid local/global ones (per-kind block tables,
  engine/hybrid_tables.py, or one table) and all-sliding ones (the blocks behind the window
  released), their synthetic weights of the tiny preset's shape;
- the decode graphs' static buffers (cuda_graphs on the CPU: the same path, run eagerly);
- tensor parallelism on the CPU (TP = 2 over gloo, its deterministic requests checked against
  the request alone at TP = 1: ~5 s to start the worker, so one seed in the fast set).

Under speculation seeded requests are compared with their solo run too: they verify by the
coupled rule, which keeps the plain draws (speculative/verify.py); the others draw from the
exact distribution by the rejection rule, their tokens not reproducible by design.
On the reference backend torch's GEMMs are not batch-invariant (~1e-6 in the logits, where the
CPU backend's are exact): a seeded draw that lands that close to a boundary between two tokens
can flip, rarely (1 of 300 seeds swept, reference 85); the seeds here do not.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from test_engine_chaos import (
    BLOCK_SIZE,
    Arrival,
    Driver,
    Outcome,
    Workload,
    check_against_alone,
    check_outputs,
    random_workload,
    run_workload,
)

from pagedkern.engine import Engine, EngineConfig
from pagedkern.engine.outputs import RequestOutput, TokenDeltas
from pagedkern.model import PRESETS, ModelConfig
from pagedkern.model.config import FULL, SLIDING

TINY_NAME = "synthetic:tiny"
TINY = PRESETS["tiny"]
# layer patterns of hybrid models: Gemma 2's alternation, Gemma 3's runs, a full layer first
HYBRID_LAYERS = ((SLIDING, FULL), (SLIDING, SLIDING, FULL), (FULL, SLIDING, SLIDING))


@dataclass(frozen=True)
class ColumnToken:
    """A plain decode token from the TokenDeltas columns, as the checks read outputs."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    finished: bool = False
    logprobs: None = None
    prompt_logprobs: None = None


class ColumnsDriver(Driver):
    """The HTTP engine core's use (serving/core/engine_core.py): no text, and a plain decode's
    token in two columns instead of an output (requests come without stop strings)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        engine.detokenize = False
        engine.token_deltas = TokenDeltas()

    def step(self, outcome: Outcome) -> None:
        """A step's columns, then its outputs: the order the engine client applies them in
        (serving/core/engine_client.py), so a request's tokens must come in that order."""
        engine = self.engine
        outputs = engine.step()
        engine.pool.check_invariants(engine.scheduler.block_tables())
        for rid, token in zip(*engine.token_deltas.take(), strict=True):
            assert rid not in outcome.aborted, f"{rid}: a column token after its abort"
            assert rid in outcome.outputs, f"{rid}: a column token before its first output"
            outcome.record([ColumnToken(rid, (token,))])  # type: ignore[list-item]
        for out in outputs:
            assert out.request_id not in outcome.aborted or out.finished, out.request_id
        outcome.record(outputs)


class StreamDriver(Driver):
    """Some requests through Engine.stream(), the rest added and stepped. Each run step either
    steps the engine, advances one open stream by an output, or closes one (cancelling its
    request); the order is drawn from `seed`, so a run repeats exactly.

    Outputs reach their consumers out of the order they were made (a stream sets the others'
    aside for the next step(), and holds its own until asked), so each output is numbered when
    made (by step() or abort()); the checks see each request's outputs in that order, an abort
    counting those made before it. Per channel (step() and each stream) they come in order;
    every output made reaches a consumer, is carried by an ABORT output (abort() folds the
    request's set-aside outputs into it) or went with a closed stream."""

    def __init__(self, engine: Engine, seed: int) -> None:
        super().__init__(engine)
        self.rng = random.Random(seed)
        self.streams: dict[str, Iterator] = {}
        self.made: dict[int, tuple[int, RequestOutput]] = {}  # id(output) -> (number, output)
        self.taken: set[int] = set()  # ids of outputs delivered, folded or closed with a stream
        self.last: dict[tuple[str, str], int] = {}  # (channel, request id) -> last number
        self.finals: set[str] = set()  # ids whose finished output a consumer has
        self.abort_at: dict[str, int] = {}  # id -> outputs numbered before its abort
        self.closing: list[RequestOutput] = []  # the ABORTs a stream's close made
        step, abort = engine.step, engine.abort

        def numbered_step() -> list[RequestOutput]:
            outputs = step()
            for out in outputs:
                self.number(out)
            return outputs

        def numbered_abort(rid: str, alone: bool = False) -> RequestOutput | None:
            ended = [] if alone else [r for r, q in engine.requests.items() if q.parent_id == rid]
            for r in [rid, *ended]:
                self.abort_at.setdefault(r, len(self.made))
            pending = [o for o in engine.output.undelivered if o.request_id == rid]
            out = abort(rid, alone=alone)
            left = {id(o) for o in engine.output.undelivered}
            self.taken |= {id(o) for o in pending if id(o) not in left}  # folded into `out`
            for o in [out, *engine.output.undelivered]:
                self.number(o)
            if out is not None:  # (the caller's: abort_checked, or a closing stream's)
                self.finals.add(rid)
                self.taken.add(id(out))
                self.closing.append(out)
            return out

        engine.step, engine.abort = numbered_step, numbered_abort  # type: ignore[method-assign]

    def number(self, out: RequestOutput | None) -> None:
        if out is not None and id(out) not in self.made:
            self.made[id(out)] = (len(self.made), out)

    def deliver(self, channel: str, outs: list[RequestOutput], outcome: Outcome) -> None:
        for out in outs:
            rid, (number, _) = out.request_id, self.made[id(out)]
            assert id(out) not in self.taken, f"{rid}: an output delivered twice"
            assert self.last.get((channel, rid), -1) < number, f"{rid}: out of order ({channel})"
            assert channel != "step" or rid not in self.finals, f"{rid}: after its final output"
            self.last[channel, rid] = number
            self.taken.add(id(out))
            self.finals |= {rid} if out.finished else set()
            outcome.record([out])

    def add(self, arrival: Arrival, outcome: Outcome) -> None:
        if self.rng.random() < 0.4:
            super().add(arrival, outcome)
            return
        rid = arrival.request_id
        stream = self.engine.stream(
            prompt_ids=arrival.prompt_ids, params=arrival.params, request_id=rid
        )
        self.streams[rid] = stream  # (admitted by the call: RequestRejected comes out of it)
        self.advance(rid, outcome)

    def advance(self, rid: str, outcome: Outcome) -> None:
        try:
            out = next(self.streams[rid])
        except StopIteration:
            del self.streams[rid]
            return
        assert rid in (out.request_id, out.parent_id), f"stream {rid} yielded {out.request_id}'s"
        self.deliver(rid, [out], outcome)

    def close(self, rid: str, outcome: Outcome) -> None:
        """The consumer leaves: what still runs of its request (every sample) is aborted, and
        every output of it no consumer has taken goes with the stream: those it held, those set
        aside for it, the ABORT outputs (the checks see them as made)."""
        engine = self.engine
        self.closing = []
        first_running = rid in engine.requests
        mine = [r for r, q in engine.requests.items() if rid in (r, q.parent_id)]
        self.streams.pop(rid).close()
        assert not any(r in engine.requests for r in mine), f"{rid}: running after its close"
        assert not first_running or self.closing, f"{rid}: no ABORT at its close"
        assert not any(rid in (o.request_id, o.parent_id) for o in engine.output.undelivered), (
            f"{rid}: outputs left behind by its closed stream"
        )
        dropped = [
            out
            for key, (_, out) in self.made.items()
            if rid in (out.request_id, out.parent_id) and key not in self.taken
        ]
        self.taken |= {id(out) for out in dropped}
        outcome.record(dropped + self.closing)
        for r in mine:
            outcome.aborted.setdefault(r, 0)  # (the count: set in finish)

    def step(self, outcome: Outcome) -> None:
        r = self.rng.random()
        if not self.streams or r < 0.35:
            self.deliver("step", self.engine.step(), outcome)
        elif r < 0.95:
            self.advance(self.rng.choice(sorted(self.streams)), outcome)
        else:
            self.close(self.rng.choice(sorted(self.streams)), outcome)

    def finish(self, outcome: Outcome) -> None:
        for rid in sorted(self.streams):  # what the open streams hold yet, then the rest
            while rid in self.streams:
                self.advance(rid, outcome)
        self.deliver("step", self.engine.pop_undelivered(), outcome)
        lost = [out for key, (_, out) in self.made.items() if key not in self.taken]
        assert not lost, f"outputs no consumer got: {lost}"
        for rid, outs in outcome.outputs.items():
            outs.sort(key=lambda out: self.made[id(out)][0])
            if rid in outcome.aborted:
                before = self.abort_at[rid]
                outcome.aborted[rid] = sum(self.made[id(o)][0] < before for o in outs)


def checked_steps(engine: Engine, limit: int = 3000) -> Engine:
    """The pool's invariants after every step, those a stream takes too; a bound on the steps
    (a stream steps until its request has an output: a stuck request would hang it)."""
    step, count = engine.step, [0]

    def checked() -> list:
        outputs = step()
        engine.pool.check_invariants(engine.scheduler.block_tables())
        count[0] += 1
        assert count[0] < limit, "the engine does not finish"
        return outputs

    engine.step = checked  # type: ignore[method-assign]
    return engine


def make_engine(model: ModelConfig | None, config: dict) -> Engine:
    """An engine of `config`, over `model` (synthetic weights of that shape) where given: the
    way Engine.from_config loads its own."""
    if model is None:
        return checked_steps(Engine.from_config(EngineConfig(**config)))
    engine_config = EngineConfig(**config)
    spec = dataclasses.replace(engine_config.model_spec(), model=model)
    engine = Engine(*spec.load(engine_config.device), engine_config)
    engine.owns_model = True
    return checked_steps(engine)


def random_model(rng: random.Random) -> ModelConfig | None:
    """The tiny preset (None), a hybrid local/global or an all-sliding model of its
    vocabulary, with a window of a few blocks or one that is not a multiple of a block."""
    kind = rng.choice(["tiny", "hybrid", "sliding"])
    if kind == "tiny":
        return None
    window = rng.choice([1, 3, 6, 8, 17])
    types = rng.choice(HYBRID_LAYERS) if kind == "hybrid" else (SLIDING,) * 2
    name = f"tiny-{kind}-{window}"
    return TINY.replace(name=name, num_layers=len(types), sliding_window=window, layer_types=types)


def with_processing(rng: random.Random, arrival: Arrival) -> Arrival:
    """A third of the requests get a logits-processing setting (test_engine_chaos draws none):
    penalties, a bias or bad words on their prompt's tokens (the model is pushed to repeat
    them, or kept from it: n-gram proposals are found, then rejected), an allowed subset,
    min-p. Speculation verifies a drafted position as if the ones before it were generated
    (speculative/verify.py), so the penalties and bans must see the drafted tokens."""
    if rng.random() < 0.67:
        return arrival
    prompt, params = arrival.prompt_ids, arrival.params
    kind = rng.choice(["presence", "frequency", "repetition", "bias", "bad", "min_p", "allowed"])
    if kind == "allowed" and params.response_format is not None:
        kind = "min_p"  # (a grammar and an allowed subset can leave no token at all)
    picks = [rng.randrange(len(prompt)) for _ in range(3)]
    change = {
        "presence": dict(presence_penalty=rng.choice([-1.5, 1.5])),
        "frequency": dict(frequency_penalty=rng.choice([-0.5, 2.0])),
        "repetition": dict(repetition_penalty=rng.choice([0.7, 1.3])),
        "bias": dict(logit_bias={prompt[i]: rng.choice([-100.0, 4.0]) for i in picks}),
        "bad": dict(bad_words=[list(prompt[i : i + 2]) for i in picks]),
        "min_p": dict(min_p=0.1),
        "allowed": dict(allowed_token_ids=sorted({*prompt, *range(3, 60)})),
    }[kind]
    return dataclasses.replace(arrival, params=dataclasses.replace(params, **change))


def surface_workload(seed: int, backend: str, front_end: bool = False) -> Workload:
    """test_engine_chaos's workload of `seed` with a model, a speculation, logits processing
    and a driver of its own (drawn from other streams, so the base workload stays that
    seed's). front_end: for the client's runs (test_engine_chaos_client.py), stop strings
    kept and solo runs through step()."""
    workload = random_workload(seed, backend)
    processing = random.Random(f"processing {seed}")
    arrivals = [with_processing(processing, a) for a in workload.arrivals]
    rng = random.Random(f"surfaces {seed}")
    config = dict(workload.config)
    model = random_model(rng)
    if model is not None and model.layer_types.count(SLIDING) < len(model.layer_types):
        config["num_blocks"] *= 2  # full and sliding layer groups: tables of each
    block_size = rng.choice([BLOCK_SIZE, BLOCK_SIZE, 1, 2, 8, 16])  # (the same tokens' room)
    config["num_blocks"] = -(-config["num_blocks"] * BLOCK_SIZE // block_size)
    config["block_size"] = block_size
    if rng.random() < 0.4:
        config.pop("async_scheduling", None)
        config["speculative"] = "draft"
        config["draft_model"] = rng.choice(["synthetic:tiny", "self:1"])
        config["num_speculative_tokens"] = rng.randint(1, 5)
    if rng.random() < 0.3:  # on the CPU: the decode graphs' static buffers, run eagerly
        config["cuda_graphs"] = True
    if model is not None and rng.random() < 0.25:  # a hybrid model's layers on one table
        config["kv_per_kind_tables"] = False
    driver = "step" if front_end else rng.choice(["step", "stream", "columns"])
    if driver == "columns":  # the front end matches stop strings: the engine core gets none
        arrivals = [
            dataclasses.replace(a, params=dataclasses.replace(a.params, stop=())) for a in arrivals
        ]
    drivers = {
        "step": Driver,
        "stream": functools.partial(StreamDriver, seed=seed),
        "columns": ColumnsDriver,
    }
    return dataclasses.replace(
        workload,
        config=config,
        arrivals=arrivals,
        make_engine=functools.partial(make_engine, model),
        driver=drivers[driver],
    )


def solo_runs(workload: Workload) -> Workload:
    """What check_against_alone runs each request alone with: streamed ones through step() (a
    stream closed at random would cut the solo run short)."""
    driver = Driver if isinstance(workload.driver, functools.partial) else workload.driver
    return dataclasses.replace(workload, driver=driver)


def run_and_check(seed: int, backend: str) -> None:
    workload = surface_workload(seed, backend)
    outcome, _ = run_workload(workload)
    check_outputs(workload, outcome)
    check_against_alone(solo_runs(workload), outcome)


# Seeds picked from sweeps of a thousand (all passing) so that together they stream, take
# columns, draft with both kinds of draft, run hybrid and all-sliding models (windows of 1 to
# 6, per-kind tables or one), the static decode buffers and block sizes 1 to 16, and each
# failed before the fix of a regression below (all but cpu 0 and 96, reference 12).
REFERENCE_SEEDS = (12, 21, 22, 29)
CPU_SEEDS = (0, 2, 62, 65, 96, 157)


@pytest.mark.parametrize("seed", REFERENCE_SEEDS)
def test_random_surface_workload_on_the_reference_backend(seed: int) -> None:
    run_and_check(seed, "reference")


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_random_surface_workload_on_the_cpu_backend(seed: int) -> None:
    run_and_check(seed, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("backend, num_seeds", [("reference", 8), ("cpu", 24)])
def test_many_random_surface_workloads(backend: str, num_seeds: int) -> None:
    for seed in range(2000, 2000 + num_seeds):
        run_and_check(seed, backend)


def tensor_parallel_workload(seed: int, engines: list[Engine]) -> Workload:
    """The seed's workload at TP = 2 (no async scheduling there), fp32 throughout so that
    TP = 1 gives the same tokens (tests/test_tensor_parallel.py), half of it streamed; the
    engines made go to `engines` (their workers stop at close, a failed run's too)."""
    workload = random_workload(seed, "cpu")
    config = dict(workload.config, tensor_parallel_size=2, quantization="none")
    config |= dict(dtype="float32", kv_cache_dtype="float32")
    config.pop("async_scheduling", None)

    def engine(config: dict) -> Engine:
        engines.append(make_engine(None, config))
        return engines[-1]

    driver = functools.partial(StreamDriver, seed=seed)
    return dataclasses.replace(workload, config=config, make_engine=engine, driver=driver)


def run_and_check_tensor_parallel(seed: int) -> None:
    engines: list[Engine] = []
    try:
        workload = tensor_parallel_workload(seed, engines)
        outcome, _ = run_workload(workload)
        check_outputs(workload, outcome)
        tp1 = dict(workload.config, tensor_parallel_size=1)  # (a worker's start per request)
        check_against_alone(dataclasses.replace(solo_runs(workload), config=tp1), outcome)
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("seed", [0])
def test_random_workload_at_tensor_parallel_2(seed: int) -> None:
    run_and_check_tensor_parallel(seed)


@pytest.mark.slow
def test_many_random_workloads_at_tensor_parallel_2() -> None:
    for seed in range(3000, 3004):
        run_and_check_tensor_parallel(seed)
