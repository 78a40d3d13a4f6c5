"""Speculative decoding (n-gram lookup) on the CPU reference ops: tokens/s with and without it,
in the same run, on a workload whose answers quote the prompt (repeat / correct a paragraph,
edit code) and on open-ended chat where lookup rarely finds anything, at batch 1 and 16; the
acceptance rate and accepted tokens per step are reported beside the speed. Greedy, so both
runs generate the same tokens. Full size (default model, 64 tokens) with
PAGEDKERN_BENCH_SMOKE=0 on a CPU machine; smoke mode uses the tiny synthetic model; skipped on
GPU machines (the GPU path is measured by bench/test_bench_e2e.py)."""

from __future__ import annotations

import time

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import Engine, EngineConfig, SamplingParams

FULL = not smoke_mode()
# The smoke run builds engines and models several times over: `slow` (CI runs it).
pytestmark = pytest.mark.slow
if FULL and torch.cuda.is_available():
    pytest.skip(
        "CPU benchmark of the reference ops; this machine has a GPU", allow_module_level=True
    )
MODEL, TOKENS = (None, 64) if FULL else ("synthetic:tiny", 12)

PARAGRAPH = (
    "The old lighthouse stood on the northern cliff for more than a century. Every night its "
    "keeper climbed the spiral stairs, trimmed the wick and polished the great lens, so that "
    "ships passing in the dark would know where the rocks were."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item.price * item.quantity\n"
    "    return total * (1 + tax_rate)\n"
)
QUOTING = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Correct any mistakes and return the whole paragraph:\n\n{PARAGRAPH.replace('the ', 'teh ')}",
    f"Rename the variable total to subtotal and return the whole function:\n\n{CODE}",
    f"Copy this text back to me unchanged:\n\n{PARAGRAPH}",
]
CHAT = [
    "Write a short story about a dragon who is afraid of the dark.",
    "What are three good habits for staying healthy?",
    "Describe your ideal weekend.",
    "Give me some ideas for a birthday party.",
]
WORKLOADS = {"quoting": QUOTING, "open chat": CHAT}


def make_engine(speculative: str) -> Engine:
    return Engine.from_config(
        EngineConfig(
            model=MODEL,
            backend="reference",
            device="cpu",
            max_num_seqs=16,
            speculative=speculative,
            enable_prefix_caching=False,  # each run computes its prompts: same work both ways
        )
    )


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    built = {mode: make_engine(mode) for mode in ("none", "ngram")}
    for engine in built.values():  # first-call costs out of timing
        engine.add_request("warm-up", SamplingParams(max_tokens=4))
        list(engine.run_until_done())
    return built


def run(engine: Engine, prompts: list[str], batch: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0)
    chats = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(batch)]
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    ids = [engine.add_request(messages=chat, params=params).request_id for chat in chats]
    for out in engine.run_until_done():
        outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return time.perf_counter() - start, [outputs[i] for i in ids]


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_speculative_speedup(engines, record, workload, batch):
    prompts = WORKLOADS[workload]
    plain_s, plain = run(engines["none"], prompts, batch)
    spec = engines["ngram"]
    before = spec.stats()
    spec_s, speculative = run(spec, prompts, batch)
    after = spec.stats()
    assert speculative == plain  # greedy: the same tokens either way
    tokens = sum(len(t) for t in plain)
    proposed = after.num_spec_proposed - before.num_spec_proposed
    accepted = after.num_spec_accepted - before.num_spec_accepted
    steps = after.num_spec_steps - before.num_spec_steps
    case = f"{workload}, batch {batch}, {TOKENS} tokens"
    op = "speculative decoding (CPU, reference ops)"
    record(op, case, "plain decode", plain_s, tokens_per_s=tokens / plain_s)
    record(
        op,
        case,
        "ngram k=4",
        spec_s,
        baseline="plain decode",
        tokens_per_s=tokens / spec_s,
        acceptance=accepted / proposed if proposed else 0.0,
        accepted_per_step=accepted / steps if steps else 0.0,
    )
