"""Tensor parallelism on the CPU (gloo, loopback): the same workload at TP = 1 and TP = N side
by side — generated tokens/s, and on rank 0 per engine step the time inside the step's
broadcast (header + packed batch), the all-reduces (2 per layer + the embedding's) and the LM
head gather, in µs. Rank 0's collective times include waiting for the slowest rank, so they
bound the communication overhead from above. Full size (the default model, fp32 weights) with
PAGEDKERN_BENCH_SMOKE=0 on a CPU machine, at TP = 3 (9 query heads); smoke mode runs the tiny
synthetic model once at TP = 2.

On a 2-core machine TP cannot speed anything up (both ranks share the same 2 cores); the numbers
show the cost of the split, not a gain. NCCL on several GPUs: not measured yet."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import LLM, SamplingParams

FULL = not smoke_mode()  # PAGEDKERN_BENCH_SMOKE=0, or a GPU machine (skipped below)
# The smoke run builds engines and models several times over: `slow` (CI runs it).
pytestmark = pytest.mark.slow
if FULL and torch.cuda.is_available():
    pytest.skip("CPU benchmark (gloo); this machine has a GPU", allow_module_level=True)
# The default model's 9 query heads split over 1, 3 or 9 ranks: TP = 3 there, TP = 2 on tiny.
MODEL, SIZE, STREAMS, TOKENS, ROUNDS = (
    (None, 3, 8, 32, 2) if FULL else ("synthetic:tiny", 2, 4, 4, 1)
)
PROMPT = [{"role": "user", "content": "Tell me about the history of Paris."}]
SETTINGS = dict(
    backend="reference", device="cpu", quantization="none", kv_cache_gib=0.25, max_num_seqs=16
)


def timed(seconds: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start

    return wrapper


def instrument(llm: LLM) -> dict:
    """Rank 0's time in each collective, accumulated (TP > 1 only)."""
    seconds: dict = defaultdict(float)
    tp = llm.engine.model.tp
    for name in ("broadcast_step", "all_reduce", "gather_logits"):
        setattr(tp, name, timed(seconds, name, getattr(tp, name)))
    return seconds


def run(llm: LLM) -> tuple[float, int]:
    """tokens/s and engine steps of STREAMS concurrent requests of TOKENS tokens each."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    steps = llm.engine.iteration
    start = time.perf_counter()
    out = llm.chat([PROMPT] * STREAMS, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(g.token_ids) == TOKENS and g.error is None for g in out)
    return STREAMS * TOKENS / seconds, llm.engine.iteration - steps


@pytest.fixture(scope="module")
def engines():
    single = LLM(MODEL, **SETTINGS)
    with LLM(MODEL, tensor_parallel_size=SIZE, **SETTINGS) as parallel:
        yield {1: single, SIZE: parallel}


def test_tensor_parallel_side_by_side(engines, record):
    for llm in engines.values():
        run(llm)  # warm-up
    seconds = instrument(engines[SIZE])
    best = {1: 0.0, SIZE: 0.0}
    steps = {1: 0, SIZE: 0}
    for _ in range(ROUNDS):
        for size, llm in engines.items():
            for name in seconds:
                seconds[name] = 0.0
            rate, n = run(llm)
            if rate > best[size]:
                best[size], steps[size] = rate, n
                per_step = {k: v / n * 1e6 for k, v in seconds.items()} if size > 1 else {}
    assert best[1] > 0 and best[SIZE] > 0 and steps[1] == steps[SIZE]
    table = "tensor parallel (CPU, default model)" if FULL else "tensor parallel (smoke)"
    layers = engines[1].engine.model.config.num_layers
    for size in (1, SIZE):
        notes = {}
        if size > 1:
            comm = sum(per_step.values())
            notes = dict(
                broadcast_us_per_step=round(per_step["broadcast_step"], 1),
                all_reduce_us_per_step=round(per_step["all_reduce"], 1),
                all_reduces_per_step=2 * layers + 1,
                gather_us_per_step=round(per_step["gather_logits"], 1),
                comm_us_per_step=round(comm, 1),
            )
        record(
            table,
            f"{STREAMS} streams x {TOKENS} tokens",
            f"TP={size}",
            STREAMS * TOKENS / best[size],
            tokens_per_s=round(best[size], 1),
            steps=steps[size],
            us_per_step=round(STREAMS * TOKENS / best[size] / steps[size] * 1e6, 1),
            **notes,
        )


LAYERS = 30 if FULL else 2  # the default model's and tiny's

# SIZE bare processes all-reducing a decode step's hidden states: the transport's own cost,
# without the other rank's compute to wait for (what the in-engine numbers above include).
ALL_REDUCE = """
import os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size={world})
x = torch.randn({rows}, {hidden})
for _ in range(20):
    dist.all_reduce(x)
dist.barrier()
start = time.perf_counter()
for _ in range({iters}):
    dist.all_reduce(x)
seconds = time.perf_counter() - start
if dist.get_rank() == 0:
    print(seconds / {iters} * 1e6)
dist.destroy_process_group()
"""


def test_bare_all_reduce_latency(record):
    hidden = 576 if FULL else 64
    iters = 500 if FULL else 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ALL_REDUCE.format(rows=STREAMS, hidden=hidden, iters=iters, world=SIZE)
    procs = []
    for rank in range(SIZE):
        env = dict(os.environ, RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
        )
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    us = float(out[0])
    assert us > 0
    record(
        f"tensor parallel all-reduce (gloo, loopback, {SIZE} processes)",
        f"[{STREAMS}, {hidden}] fp32",
        "dist.all_reduce",
        us * 1e-6,
        us_per_all_reduce=round(us, 1),
        all_reduces_per_step=2 * LAYERS + 1,
        us_per_step=round(us * (2 * LAYERS + 1), 1),
    )
