"""Host cost of one engine decode step, in total and per component, at 1, 64, 256 and 1024
running sequences of `synthetic:tiny` on the CPU.

The forward pass and the sampler are stubs (patched here, not in the engine): the stub model
returns a preallocated logits block, the stub `ops.sample` a deterministic id per row from the
seeds and offsets it was given. What is left is the host's own work between two GPU steps:
scheduling, batch layout and upload, sampling-parameter packing, append and stop checks,
detokenization, output objects, the runner's own code (its chunks and row bookkeeping) and
the engine loop around them.

Times are the engine thread's CPU time (time.thread_time): the dev machine's 2 cores are shared,
and wall time there mostly measures the neighbours (the host work is single-threaded, so on an
idle machine the two agree). Two passes per size: the step total is timed unwrapped (median
and min over the steps); the components are timed in a second pass with a wrapper around each
(each component's self time: a wrapped call inside another is charged to the callee, and the
wrapper's own cost, measured here, is subtracted per call: what it adds to its caller and the
~0.5 us clock read it reports even for an empty call), as means per step. "sampling params"
is runner.sample, the general path's packing (the persistent decode batch packs its rows in
"runner (own)"). "append/stop checks" is OutputProcessor.append, a step's whole append (it
calls no per-request method but the detokenizer's and the output's); "engine loop (rest)" is
Engine.step's self time: the engine's own per-step code. Target: <= 0.5 ms per step at 256.
Smoke mode (CI): every size, a few steps; the numbers mean nothing there.

Each size runs twice: detokenizing (the offline engine: `LLM`, the CLI; half the requests check
a stop string) and not (`Engine.detokenize` off: the HTTP server's engine core, whose front
end detokenizes and matches stop strings in its own process; no stop strings reach the core;
its decode tokens come out as two columns, `Engine.token_deltas`, not as output objects).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from measure import smoke_mode

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine import runner as runner_module
from pagedkern.engine.detokenizer import IncrementalDetokenizer
from pagedkern.engine.outputs import RequestOutput, TokenDeltas
from pagedkern.model.collectives import SINGLE

SIZES = [1, 64, 256, 1024]
STEPS = 3 if smoke_mode() else 200
OP = "engine host cost (stub forward + sampler)"
CLOCK = time.thread_time  # CPU seconds of this thread


class StubModel:
    """Stands in for LlamaModel in the runner: no forward work, logits of the right shape."""

    def __init__(self, vocab: int, rows: int):
        self.tp = TimedTP()
        self.device = torch.device("cpu")
        self.logits = torch.zeros(rows, vocab)

    def __call__(self, input_ids, meta, kv_cache) -> torch.Tensor:
        return self.logits[: meta.logits_indices.shape[0]]

    def hidden_states(self, input_ids, meta, kv_cache) -> None:
        return None


class TimedTP:
    """The TP = 1 context with its upload timed (the runner uploads through model.tp)."""

    def __init__(self) -> None:
        self.upload = SINGLE.upload
        self.fatal_errors = SINGLE.fatal_errors


class Timers:
    """Self time and calls per component: `wrap` times one callable and charges a wrapped call
    made inside it to that callee, not to the caller (a stack of open calls), so every
    component is its own code's time whichever path calls what (the persistent decode batch
    calls the sampler straight from the runner, the general path through runner.sample)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.overhead = 0.0  # seconds a wrapper adds to its caller per call (calibrate)
        self.floor = 0.0  # seconds a wrapper reports for an empty call (its clock's own cost)
        self._inner: list[float] = []  # per open call: seconds its wrapped callees took

    def wrap(self, name: str, fn: Callable) -> Callable:
        clock, seconds, calls, inner = CLOCK, self.seconds, self.calls, self._inner

        def timed(*args, **kwargs):
            inner.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = clock() - start
                callees = inner.pop()
                seconds[name] += took - callees - self.floor
                calls[name] += 1
                if inner:
                    inner[-1] += took + self.overhead

        return timed

    def calibrate(self) -> None:
        probe = Timers()
        inner = probe.wrap("probe", lambda: None)
        outer = probe.wrap("outer", inner)
        for _ in range(20000):
            outer()
        # What a nested wrapper adds to its caller's time beyond what it reports, per call,
        # and what it reports for a call that does nothing (~one clock read: 0.5 us, the size
        # of a small component's whole call, e.g. one output object).
        # (the probe's timers have neither: "outer" is its own time, less "probe"'s raw one)
        self.floor = probe.seconds["probe"] / 20000
        self.overhead = max(0.0, probe.seconds["outer"] / 20000)


def stub_sample(logits, temperature, top_p, top_k, seeds, offsets, **kwargs) -> torch.Tensor:
    """A deterministic id per row in [5, 505) (synthetic:tiny's vocabulary is 512)."""
    return ((seeds + offsets * 7) % 500 + 5).to(torch.int32)


def running_engine(num_seqs: int, monkeypatch, detokenize: bool = True) -> Engine:
    engine = Engine.from_config(
        EngineConfig(
            model="synthetic:tiny",
            backend="reference",
            device="cpu",
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, 64 * num_seqs),
            num_blocks=num_seqs * 48,
            block_size=16,
        )
    )
    engine.runner.model = StubModel(engine.vocab_size, num_seqs)
    engine.detokenize = detokenize
    if not detokenize:  # as the HTTP core: plain decode tokens as two columns, no outputs
        engine.token_deltas = TokenDeltas()
    monkeypatch.setattr(ops, "sample", stub_sample)
    for i in range(num_seqs):
        params = SamplingParams(
            max_tokens=10**6,
            ignore_eos=True,
            temperature=0.8,
            top_p=0.95,
            seed=i,
            # half the requests check a stop string (where the engine matches them)
            stop=["pagedkern-stop"] if i % 2 and detokenize else [],
        )
        prompt = [(i * 7 + j) % 500 + 5 for j in range(40 + i % 50)]
        engine.add_request(prompt_ids=prompt, params=params)
    running = engine.scheduler.running
    while len(running) < num_seqs or any(r.num_uncomputed > 1 for r in running):
        engine.step()  # the prompts' prefill
    for _ in range(3):
        engine.step()
    if engine.token_deltas is not None:
        engine.token_deltas.take()  # (the warm-up's)
    return engine


def instrument(engine: Engine, timers: Timers, monkeypatch) -> None:
    scheduler, runner = engine.scheduler, engine.runner
    monkeypatch.setattr(scheduler, "schedule", timers.wrap("scheduler", scheduler.schedule))
    monkeypatch.setattr(scheduler, "on_step_done", timers.wrap("scheduler", scheduler.on_step_done))
    monkeypatch.setattr(
        runner_module, "layout_batch", timers.wrap("batch layout", runner_module.layout_batch)
    )
    tp = runner.model.tp
    tp.upload = timers.wrap("upload", tp.upload)
    monkeypatch.setattr(runner, "sample", timers.wrap("sampling params", runner.sample))
    monkeypatch.setattr(runner, "run", timers.wrap("runner (own)", runner.run))
    monkeypatch.setattr(ops, "sample", timers.wrap("sampler stub", ops.sample))
    append = timers.wrap("append/stop checks", engine.output.append)  # a step's whole append
    monkeypatch.setattr(engine.output, "append", append)
    add = IncrementalDetokenizer.add
    monkeypatch.setattr(IncrementalDetokenizer, "add", timers.wrap("detokenize", add))
    of = RequestOutput.of.__func__
    monkeypatch.setattr(RequestOutput, "of", classmethod(timers.wrap("output objects", of)))
    monkeypatch.setattr(engine, "step", timers.wrap("step", engine.step))


@pytest.mark.parametrize("detokenize", [True, False], ids=["detokenize", "ids-only"])
@pytest.mark.parametrize("num_seqs", SIZES)
def test_engine_step_host_cost(num_seqs, detokenize, record, monkeypatch, capsys):
    engine = running_engine(num_seqs, monkeypatch, detokenize)
    before = sum(len(r.output_ids) for r in engine.requests.values())

    times, texts = [], False
    for _ in range(STEPS):
        start = CLOCK()
        outputs = engine.step()
        times.append(CLOCK() - start)
        columns = engine.token_deltas.take()[0] if engine.token_deltas is not None else []
        assert len(outputs) + len(columns) == num_seqs and not any(o.finished for o in outputs)
        assert detokenize or not outputs  # the HTTP core's steady decode: columns only
        texts = texts or any(o.text for o in outputs)
    assert texts == detokenize  # (the stub's ids do decode to text)
    step = statistics.median(times)

    timers = Timers()
    timers.calibrate()
    instrument(engine, timers, monkeypatch)
    for _ in range(STEPS):
        engine.step()
        if engine.token_deltas is not None:
            engine.token_deltas.take()
    after = sum(len(r.output_ids) for r in engine.requests.values())
    assert after - before == 2 * STEPS * num_seqs  # every step decoded every sequence once
    for request in engine.requests.values():  # the stub sampler's ids really were appended
        seed, n = request.seed, len(request.output_ids)
        assert request.output_ids[-1] == (seed + (n - 1) * 7) % 500 + 5

    names = ["scheduler", "batch layout", "upload", "sampling params", "runner (own)"]
    names += ["append/stop checks", "detokenize", "output objects"]
    components = {name: timers.seconds[name] for name in names}
    components["engine loop (rest)"] = timers.seconds["step"]  # the sampler stub: its own
    case = f"{num_seqs} running" + ("" if detokenize else ", no detokenization (HTTP core)")
    record(
        OP,
        case,
        "step (unwrapped)",
        step,
        us_per_seq=step * 1e6 / num_seqs,
        min_us=min(times) * 1e6,
    )
    for name, seconds in components.items():
        record(OP, case, name, seconds / STEPS, us_per_seq=seconds * 1e6 / STEPS / num_seqs)
    with capsys.disabled():
        cells = ", ".join(f"{k} {v * 1e6 / STEPS:.0f}" for k, v in components.items())
        print(
            f"\n{case}: step {step * 1e6:.0f} us, min {min(times) * 1e6:.0f} ({cells}; us per step)"
        )
