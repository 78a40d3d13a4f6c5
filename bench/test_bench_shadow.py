"""Shadow mode's cost on the CPU engine: the same greedy batch generated with shadow mode off and
on (every compared op also runs its PyTorch reference on copies of its inputs and is compared),
rounds interleaved in one run, median seconds per generated token and the ratio. On the CPU the
op is the reference, so this is the bookkeeping and the second computation, the floor of what a
GPU run pays on top of its kernels."""

from __future__ import annotations

import statistics
import time

import pytest

from pagedkern.engine import LLM, SamplingParams

MODEL = "synthetic:tiny"


@pytest.mark.parametrize("batch", [1, 8])
def test_shadow_mode_cost_on_the_cpu_engine(record, smoke, batch):
    tokens = 4 if smoke else 32
    rounds = 1 if smoke else 5
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 40 + i)) for i in range(batch)]
    engines = {mode: LLM(MODEL, shadow=mode, num_blocks=64) for mode in ("off", "on")}
    for llm in engines.values():  # warm-up: first-call costs out of the rounds
        llm.generate(prompts, params, use_tqdm=False)
    outputs, seconds = {}, {mode: [] for mode in engines}
    for _ in range(rounds):
        for mode, llm in engines.items():  # interleaved: both see the same load
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            seconds[mode].append((time.perf_counter() - start) / (tokens * batch))
            outputs[mode] = [g.token_ids for g in out]
    assert outputs["on"] == outputs["off"], "shadow mode changes nothing the engine computes"
    assert engines["on"].engine.shadow.first is None
    off, on = (statistics.median(seconds[m]) for m in ("off", "on"))
    case = f"{MODEL} batch {batch}, {tokens} tokens"
    record("shadow mode", case, "off", off)
    record("shadow mode", case, "on", on, cost=f"{on / off:.2f}x off")
