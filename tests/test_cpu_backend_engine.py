"""The engine on the CPU backend keeps greedy outputs independent of batch make-up, as on the
reference (tests/test_engine.py): continuous batching, preemption, chunked prefill and n-gram
speculation give each request what it gets alone, with prompts long enough that attention
crosses key tiles (256 keys) and decode steps take the CPU decode step; with fp32 weights (the
layer loop, the fixed-order GEMM) and int4 weights (every step through the C++ decoder,
ops/cpu/decoder.py). Seeded sampling goes further: each request's log-probabilities are the
same bits batched as alone."""

from __future__ import annotations

import random

import pytest
from test_engine import run_checked

from pagedkern.engine import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SCENARIOS = {
    "continuous batching": {},
    "preemption (tiny KV pool)": {"num_blocks": 160},
    "chunked prefill (64-token budget)": {"max_num_batched_tokens": 64},
    "n-gram speculation": {"speculative": "ngram", "num_speculative_tokens": 3},
}


def _engine(**overrides) -> Engine:
    config = dict(
        model="synthetic:tiny", backend="cpu", num_blocks=1024, block_size=4, max_num_seqs=16,
        max_num_batched_tokens=1024,
    )  # fmt: skip
    return Engine.from_config(EngineConfig(**{**config, **overrides}))


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    lengths = [1, 9, 40, 250, 300, 330, 420, 17]
    # repeated runs so n-gram lookup finds proposals
    return [[rng.randrange(3, 60) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["none", "int4"])
def solo(request):
    prompts = _prompts()
    engine = _engine(quantization=request.param)
    outputs = []
    for ids in prompts:
        engine.add_request(prompt_ids=ids, params=GREEDY)
        outputs.append(next(iter(run_checked(engine).values())))
    return prompts, outputs, request.param


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_batched_greedy_equals_solo_on_the_cpu_backend(solo, scenario):
    prompts, expected, quantization = solo
    engine = _engine(quantization=quantization, **SCENARIOS[scenario])
    assert engine.backend == "cpu"
    requests = [engine.add_request(prompt_ids=p, params=GREEDY) for p in prompts]
    got = run_checked(engine)
    assert [got[r.request_id] for r in requests] == expected
    if "preemption" in scenario:
        assert sum(r.num_preemptions for r in requests) > 0


def test_the_runner_draws_through_the_cpu_backends_own_sampler(monkeypatch):
    """Its arrays are its own: the CPU backend's function without ops.sample's checks, the same
    tokens and logprobs as through ops.sample."""
    from pagedkern import ops
    from pagedkern.engine import runner

    calls = []
    real = ops.sample
    monkeypatch.setattr(ops, "sample", lambda *a, **k: calls.append(a) or real(*a, **k))
    params = [
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=11, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.2, top_k=5, seed=3, presence_penalty=0.5),
    ]
    outputs = []
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(runner, "_sampler", lambda device: ops.sample)
        engine = Engine.from_config(EngineConfig(model="synthetic:tiny", backend="cpu"))
        for i, p in enumerate(params):
            engine.add_request(prompt_ids=list(range(3, 12 + i)), params=p)
        done = {o.request_id: o for o in engine.run_until_done() if o.finished}
        outputs.append([(o.token_ids, o.logprobs) for _, o in sorted(done.items())])
        if direct:
            assert calls == []  # (the runner's draws skipped ops.sample)
    assert calls  # (and the other engine's took it)
    assert outputs[0] == outputs[1]


def _sampled(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True, logprobs=0)


def _sampled_run(engine: Engine, prompts: list[tuple[int, list[int]]]) -> list[list[tuple]]:
    """(token, its log-probability) per step, per request."""
    requests = [engine.add_request(prompt_ids=p, params=_sampled(i)) for i, p in prompts]
    got: dict[str, list[tuple]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            steps = zip(out.token_ids, out.logprobs, strict=True)
            got.setdefault(out.request_id, []).extend((t, lp.logprob) for t, lp in steps)
    assert engine.pool.num_used == 0
    return [got[r.request_id] for r in requests]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_sampled_log_probabilities_are_the_same_bits_batched_as_alone(quantization):
    # fp32 weights: torch's BLAS rounds a row apart with other rows beside it (every request
    # differed at some step with cpu_linear:blas); the fixed-order GEMM does not
    prompts = _prompts()
    solo_engine = _engine(quantization=quantization)
    solo = [_sampled_run(solo_engine, [(i, p)])[0] for i, p in enumerate(prompts)]
    for scenario in ("continuous batching", "preemption (tiny KV pool)"):
        engine = _engine(quantization=quantization, **SCENARIOS[scenario])
        assert _sampled_run(engine, list(enumerate(prompts))) == solo, scenario
