"""Self-speculation (`--draft-model self:N`) on the CPU: how often the target's first N layers
guess its greedy tokens, what a proposal costs, and (once the speculative engine step exists)
tokens/s with and without speculation, batch 1 and 16.

Acceptance is measured offline, exactly as greedy verification would decide it: the target's
non-speculative greedy continuation is the truth; each step the draft proposes K tokens from the
prefix decoded so far, the longest prefix equal to the truth is accepted, and the target's next
token follows (so a step yields accepted + 1 tokens). Full size (default model, 32 tokens, N in
2, 4, 8, 29, 30) with PAGEDKERN_BENCH_SMOKE=0 on a CPU machine; smoke mode uses the tiny
synthetic model."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.request import Request
from pagedkern.engine.speculative.draft import DraftProposer

FULL = not smoke_mode()
# The smoke run builds engines and models several times over: `slow` (CI runs it).
pytestmark = pytest.mark.slow
if FULL and torch.cuda.is_available():
    pytest.skip(
        "CPU benchmark of the reference ops; this machine has a GPU", allow_module_level=True
    )
# self:L (all layers) must accept every proposal: a check of the measurement itself.
MODEL, TOKENS, LAYERS = (None, 32, (2, 4, 8, 29, 30)) if FULL else ("synthetic:tiny", 8, (1, 2))
K = 4  # num_speculative_tokens
BATCHES = (1, 16)
SPECULATIVE = "speculative" in {f.name for f in dataclasses.fields(EngineConfig)}
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Repeat this sentence: the quick brown fox jumps over the lazy dog.",
    "Write a haiku about rain.",
    "Correct the spelling: Teh cat sat on teh mat.",
    "Explain photosynthesis in one sentence.",
    "List the numbers from one to ten.",
    "Write a Python function that adds two numbers.",
]
PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


def config(**speculative) -> EngineConfig:
    return EngineConfig(
        model=MODEL, backend="reference", device="cpu", max_num_seqs=16, **speculative
    )


def chats(batch: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
        for i in range(batch)
    ]


def timed_greedy(engine: Engine, batch: int) -> tuple[list[tuple], list[list[int]], float]:
    """Every chat's prompt ids and greedy ids, and the wall time of the batched run."""
    start = time.perf_counter()
    requests = [engine.add_request(messages=c, params=PARAMS) for c in chats(batch)]
    out: dict[str, list[int]] = {}
    for o in engine.run_until_done():
        out.setdefault(o.request_id, []).extend(o.token_ids)
    seconds = time.perf_counter() - start
    return [r.prompt_ids for r in requests], [out[r.request_id] for r in requests], seconds


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine.from_config(config())
    engine.add_request("warm-up", SamplingParams(max_tokens=4))  # first-call costs out of timing
    list(engine.run_until_done())
    return engine


@pytest.fixture(scope="module")
def baseline(engine):
    """Per batch size: the target's greedy continuations and their tokens/s."""
    return {b: timed_greedy(engine, b) for b in BATCHES}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("layers", LAYERS)
def test_self_draft_acceptance(engine, baseline, record, layers, batch):
    prompts, truth, seconds = baseline[batch]
    proposer = DraftProposer.create(f"self:{layers}", engine.model, engine.kv_cache, engine.config)
    bs = engine.config.block_size
    width = max(-(-(len(p) + TOKENS + K) // bs) for p in prompts)  # blocks per request
    assert batch * width <= proposer.kv_cache.num_blocks
    requests = []
    for i, prompt in enumerate(prompts):
        r = Request(f"B{i}", prompt, PARAMS)
        r.block_table = list(range(i * width, (i + 1) * width))
        r.output_ids.append(truth[i][0])  # the prefill's token: speculation starts after it
        requests.append(r)
    proposed = accepted = steps = request_steps = 0
    draft_seconds = 0.0
    while active := [r for r in requests if len(r.output_ids) < TOKENS]:
        want = [truth[int(r.request_id[1:])] for r in active]
        ks = [min(K, TOKENS - len(r.output_ids) - 1) for r in active]  # room for the + 1
        start = time.perf_counter()
        proposals = proposer.propose(active, ks)
        draft_seconds += time.perf_counter() - start
        steps += 1
        request_steps += len(active)
        for r, p, w in zip(active, proposals, want, strict=True):
            done = len(r.output_ids)
            a = 0
            while a < len(p.token_ids) and p.token_ids[a] == w[done + a]:
                a += 1
            r.output_ids += w[done : done + a + 1]
            proposed += len(p.token_ids)
            accepted += a
    assert [r.output_ids for r in requests] == truth
    if layers == engine.model.config.num_layers:
        assert accepted == proposed, "the target itself as its draft must always be accepted"
    generated = batch * (TOKENS - 1)
    record(
        "self-draft acceptance (CPU, greedy, offline verification)",
        f"batch {batch}, {TOKENS} tokens, k={K}",
        f"self:{layers} of {engine.model.config.num_layers}",
        draft_seconds,
        acceptance=accepted / max(proposed, 1),
        tokens_per_request_step=generated / request_steps,
        draft_ms_per_step=1e3 * draft_seconds / steps,
        target_ms_per_decode_step=1e3 * seconds / TOKENS,
    )


@pytest.mark.skipif(not SPECULATIVE, reason="EngineConfig has no speculative fields yet")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("layers", LAYERS)
def test_self_speculation_tokens_per_s(baseline, record, layers, batch):
    _, truth, seconds = baseline[batch]
    spec = Engine.from_config(
        config(speculative="draft", draft_model=f"self:{layers}", num_speculative_tokens=K)
    )
    spec.add_request("warm-up", SamplingParams(max_tokens=4))
    list(spec.run_until_done())
    _, ids, spec_seconds = timed_greedy(spec, batch)
    assert ids == truth  # greedy speculation changes nothing but the speed
    tokens = batch * TOKENS
    record(
        "self-speculation e2e (CPU, reference ops, greedy)",
        f"batch {batch}, {TOKENS} tokens, k={K}",
        f"self:{layers}",
        spec_seconds,
        tokens_per_s=tokens / spec_seconds,
        baseline_tokens_per_s=tokens / seconds,
        speedup=seconds / spec_seconds,
    )
