"""End-to-end CPU throughput of the engine on the reference ops: a 32-prompt batch with
continuous batching vs the same prompts one by one. Full size (default model, 32 prompts x 32
tokens) with PAGEDKERN_BENCH_SMOKE=0 on a CPU machine; smoke mode uses the tiny synthetic model;
skipped on GPU machines (tools/gpu_check.sh measures the GPU path)."""

from __future__ import annotations

import time

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import Engine, EngineConfig, SamplingParams

FULL = not smoke_mode()  # PAGEDKERN_BENCH_SMOKE=0, or a GPU machine (skipped below)
if FULL and torch.cuda.is_available():
    pytest.skip(
        "CPU benchmark of the reference ops; this machine has a GPU (bench/test_bench_e2e.py "
        "measures the GPU path)",
        allow_module_level=True,
    )
MODEL, PROMPTS, TOKENS = (None, 32, 32) if FULL else ("synthetic:tiny", 8, 8)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water?",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine.from_config(
        EngineConfig(model=MODEL, backend="reference", device="cpu", max_num_seqs=PROMPTS)
    )
    engine.add_request("warm-up", SamplingParams(max_tokens=4))  # first-call costs out of timing
    list(engine.run_until_done())
    return engine


@pytest.mark.parametrize("mode", ["continuous batching", "one by one"])
def test_engine_throughput(engine, record, mode):
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    chats = [
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
        for i in range(PROMPTS)
    ]
    start = time.perf_counter()
    tokens = 0
    if mode == "continuous batching":
        for chat in chats:
            engine.add_request(messages=chat, params=params)
        tokens = sum(len(o.token_ids) for o in engine.run_until_done())
    else:
        for chat in chats:
            engine.add_request(messages=chat, params=params)
            tokens += sum(len(o.token_ids) for o in engine.run_until_done())
    seconds = time.perf_counter() - start
    assert tokens == PROMPTS * TOKENS
    record(
        "engine e2e (CPU, reference ops)",
        f"{PROMPTS} prompts x {TOKENS} tokens",
        mode,
        seconds,
        tokens_per_s=tokens / seconds,
    )
