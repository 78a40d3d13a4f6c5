"""Asynchronous scheduling (EngineConfig.async_scheduling): how much of the engine thread's host
work overlaps the execution of the step before it, and what that does to decode throughput,
with overlap off and on, on the same workload in the same run.

Workload: `synthetic:tiny` on the device (the CPU reference ops in smoke mode and without a GPU),
S sequences decoding T tokens each (seeded sampling, half with a stop string), prompts admitted
together. Host work: the engine thread's scheduler, layout / sampling inputs (runner.prepare)
and append / stop checks / outputs (OutputProcessor.append); execution: runner.execute (on the
worker thread with overlap on, inline with it off). Both are timed as wall-clock intervals
(time.perf_counter); the overlap fraction is the share of host-work time that falls inside an
execution interval: 0 by construction with overlap off, 1 if the host never kept the device
waiting (with overlap off the sampling inputs are built inside execute, with it on in
prepare: the host totals differ by that). On the CPU the worker's forward is Python op dispatch
that holds the GIL between ops, so the engine thread's host work waits for the GIL while it
overlaps: less of it overlaps than on a GPU, where the worker mostly waits on the device with
the GIL released. Throughput is output tokens over the wall time of the whole run (the 2-core dev
machine is shared: read it as indicative). Outputs with overlap on must equal those with it off.
Smoke mode (CI): 8 sequences x 4 tokens; PAGEDKERN_BENCH_SMOKE=0: 1, 64 and 256 sequences x 64.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import Engine, EngineConfig, SamplingParams

CASES = [(8, 4)] if smoke_mode() else [(1, 64), (64, 64), (256, 64)]
OP = "async scheduling (overlap of host work with execution)"
CLOCK = time.perf_counter
# The CUDA kernels where a GPU is usable (outside smoke mode), else the CPU reference ops.
DEVICE = "cuda" if not smoke_mode() and torch.cuda.is_available() else "cpu"


class Intervals:
    """Wall-clock [start, end) intervals of the calls of wrapped callables."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def wrap(self, fn: Callable) -> Callable:
        spans = self.spans

        def timed(*args, **kwargs):
            start = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((start, CLOCK()))

        return timed

    @property
    def total(self) -> float:
        return sum(b - a for a, b in self.spans)

    def inside(self, other: Intervals) -> float:
        """Seconds of these intervals that fall inside `other`'s (other's are disjoint: one
        worker runs one step at a time)."""
        busy = sorted(other.spans)
        seconds = 0.0
        for a, b in self.spans:
            for c, d in busy:
                if c >= b:
                    break
                seconds += max(0.0, min(b, d) - max(a, c))
        return seconds


def run(num_seqs: int, tokens: int, overlap: bool, device: str) -> tuple[dict, dict]:
    engine = Engine.from_config(
        EngineConfig(
            model="synthetic:tiny",
            backend="reference" if device == "cpu" else "auto",
            device=device,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, 64 * num_seqs),
            num_blocks=num_seqs * 16,
            block_size=16,
            async_scheduling=overlap,
        )
    )
    host, execution = Intervals(), Intervals()
    scheduler, runner = engine.scheduler, engine.runner
    scheduler.schedule = host.wrap(scheduler.schedule)
    runner.prepare = host.wrap(runner.prepare)
    runner.execute = execution.wrap(runner.execute)
    engine.output.append = host.wrap(engine.output.append)
    for i in range(num_seqs):
        params = SamplingParams(
            max_tokens=tokens,
            ignore_eos=True,
            temperature=0.8,
            seed=i,
            stop=["pagedkern-stop"] if i % 2 else [],
        )
        engine.add_request(
            prompt_ids=[(i * 7 + j) % 500 + 5 for j in range(16 + i % 16)], params=params
        )
    outputs: dict[str, list[int]] = {}
    start = CLOCK()
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    wall = CLOCK() - start
    engine.close()
    assert engine.pool.num_used == 0
    overlapped = host.inside(execution)
    stats = {
        "wall": wall,
        "host": host.total,
        "execution": execution.total,
        "overlap": overlapped / host.total if host.total else 0.0,
        "tok_s": num_seqs * tokens / wall,
        "steps": engine.iteration,
    }
    return outputs, stats


@pytest.mark.parametrize("num_seqs,tokens", CASES)
def test_async_scheduling_overlap(num_seqs, tokens, record, capsys):
    device = DEVICE
    plain, off = run(num_seqs, tokens, False, device)
    overlapped, on = run(num_seqs, tokens, True, device)
    assert overlapped == plain, "overlap changed the outputs"
    assert off["overlap"] == 0.0  # one thread: host work and execution never coincide
    assert 0.0 <= on["overlap"] <= 1.0
    case = f"{num_seqs} seqs x {tokens} tokens ({device})"
    for name, stats in (("overlap off", off), ("overlap on", on)):
        record(
            OP,
            case,
            name,
            stats["wall"] / stats["steps"],
            overlap_fraction=round(stats["overlap"], 3),
            host_ms=round(stats["host"] * 1e3, 1),
            execution_ms=round(stats["execution"] * 1e3, 1),
            tok_s=round(stats["tok_s"], 1),
            baseline="overlap off",
        )
    with capsys.disabled():
        print(
            f"\n{case}: overlap off {off['tok_s']:.0f} tok/s (host {off['host'] * 1e3:.0f} ms, "
            f"execution {off['execution'] * 1e3:.0f} ms); overlap on {on['tok_s']:.0f} tok/s "
            f"(host {on['host'] * 1e3:.0f} ms, execution {on['execution'] * 1e3:.0f} ms, "
            f"{on['overlap']:.0%} of host work overlapped)"
        )
