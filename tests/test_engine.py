"""The serving engine on the CPU: continuous batching gives each request exactly what it would
get alone (also under preemption, chunked prefill and prefix caching), seeded sampling does not
depend on the batch, every stop condition ends a request and gives its blocks back."""

from __future__ import annotations

import random

import pytest

from pagedkern.engine import (
    LLM,
    Engine,
    EngineConfig,
    FinishReason,
    RequestRejected,
    SamplingParams,
)

TINY = "synthetic:tiny"


def make_engine(**overrides) -> Engine:
    config = dict(
        model=TINY,
        backend="reference",
        num_blocks=512,
        block_size=4,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


def run_checked(engine: Engine) -> dict[str, list[int]]:
    """Run to completion, checking the pool invariants after every step; token ids by request."""
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        engine.pool.check_invariants(engine.scheduler.block_tables())
    assert engine.pool.num_used == 0, "blocks leaked"
    return outputs


def varied_prompts(n: int = 18, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(7)
    prompts = []
    for i in range(n):
        length = rng.choice([1, 3, 17, 40, 90, 150]) + i
        prompts.append((shared_prefix or []) + [rng.randrange(3, 500) for _ in range(length)])
    return prompts


def solo_outputs(prompts, params) -> list[list[int]]:
    engine = make_engine()
    results = []
    for ids in prompts:
        engine.add_request(prompt_ids=ids, params=params)
        results.append(next(iter(run_checked(engine).values())))
    return results


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SCENARIOS = {
    "continuous batching": {},
    "preemption (tiny KV pool)": {"num_blocks": 70},
    "chunked prefill (16-token budget)": {"max_num_batched_tokens": 16},
    "no prefix caching": {"enable_prefix_caching": False},
}


@pytest.fixture(scope="module")
def solo():
    prompts = varied_prompts()
    return prompts, solo_outputs(prompts, GREEDY)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_batched_greedy_equals_solo(solo, scenario):
    prompts, expected = solo
    engine = make_engine(**SCENARIOS[scenario])
    requests = [engine.add_request(prompt_ids=p, params=GREEDY) for p in prompts]
    got = run_checked(engine)
    assert [got[r.request_id] for r in requests] == expected
    if "preemption" in scenario:
        assert sum(r.num_preemptions for r in requests) > 0
    if "chunked" in scenario:
        assert max(len(p) for p in prompts) > 16  # long prompts had to be split


def test_prefix_caching_hits_and_matches_solo():
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(40)]  # 10 full blocks of 4
    prompts = varied_prompts(16, shared_prefix=system)
    expected = solo_outputs(prompts, GREEDY)
    engine = make_engine(max_num_seqs=4)  # later requests arrive after the prefix is cached
    requests = [engine.add_request(prompt_ids=p, params=GREEDY) for p in prompts]
    got = run_checked(engine)
    assert [got[r.request_id] for r in requests] == expected
    assert engine.pool.hit_rate > 0
    # the first 4 are admitted together, before the prefix is cached; the 12 others hit it all
    assert sum(r.num_cached_tokens for r in requests) >= 12 * 40


def test_seeded_sampling_does_not_depend_on_the_batch():
    params = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    prompt = varied_prompts(1)[0]
    alone = solo_outputs([prompt], params)[0]
    engine = make_engine()
    others = [
        engine.add_request(
            prompt_ids=p,
            params=SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True),
        )
        for i, p in enumerate(varied_prompts(5))
    ]
    target = engine.add_request(prompt_ids=prompt, params=params)
    got = run_checked(engine)
    assert got[target.request_id] == alone
    assert len({tuple(got[r.request_id]) for r in others}) > 1


def test_stop_token_ids_max_tokens_and_context_length():
    prompt = varied_prompts(1)[0]
    free_run = solo_outputs([prompt], GREEDY)[0]
    engine = make_engine(max_model_len=len(prompt) + 5)
    stop_at = engine.add_request(
        prompt_ids=prompt,
        params=SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[free_run[3]]
        ),
    )
    length = engine.add_request(
        prompt_ids=prompt, params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )
    context = engine.add_request(prompt_ids=prompt, params=GREEDY)
    got = run_checked(engine)
    first = free_run.index(free_run[3])
    assert got[stop_at.request_id] == free_run[: first + 1]
    assert stop_at.finish_reason is FinishReason.STOP
    assert got[length.request_id] == free_run[:3] and length.finish_reason is FinishReason.LENGTH
    assert got[context.request_id] == free_run[:5]
    assert context.finish_reason is FinishReason.CONTEXT


def test_cancellation_and_timeout_free_their_blocks():
    clock = [1000.0]
    engine = make_engine()
    engine.clock = lambda: clock[0]
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    cancelled = engine.add_request(prompt_ids=varied_prompts(1)[0], params=long)
    timed = engine.add_request(
        prompt_ids=varied_prompts(2)[1],
        params=SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, timeout=5.0),
    )
    keeps = engine.add_request(prompt_ids=varied_prompts(3)[2], params=GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    out = engine.abort(cancelled.request_id)
    assert out.finished and cancelled.finish_reason is FinishReason.ABORT
    engine.pool.check_invariants(engine.scheduler.block_tables())
    clock[0] += 6.0  # past the 5 s timeout
    outputs = engine.step()
    assert any(o.request_id == timed.request_id and o.finished for o in outputs)
    assert timed.finish_reason is FinishReason.TIMEOUT
    run_checked(engine)
    assert keeps.finish_reason is FinishReason.LENGTH and len(keeps.output_ids) == 12


def test_a_failing_step_finishes_its_requests_and_the_engine_lives_on(monkeypatch):
    engine = make_engine()
    victim = engine.add_request(prompt_ids=[5, 6, 7], params=GREEDY)
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda entries, forks=None: 1 / 0)
    outputs = engine.step()
    assert victim.finish_reason is FinishReason.ERROR and "ZeroDivisionError" in victim.error
    assert [o.finished for o in outputs] == [True]
    assert engine.pool.num_used == 0
    monkeypatch.setattr(engine.runner, "run", real_run)
    engine.add_request(prompt_ids=[5, 6, 7], params=GREEDY)
    assert len(next(iter(run_checked(engine).values()))) == 12


def test_bad_requests_are_rejected_at_once():
    with pytest.raises(RequestRejected, match="context of 64"):
        make_engine(max_model_len=64).add_request(prompt_ids=list(range(3, 70)))
    engine = make_engine(num_blocks=8, max_model_len=64)  # the cache holds 32 tokens
    with pytest.raises(RequestRejected, match="context of 32"):
        engine.add_request(prompt_ids=list(range(3, 40)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("")
    with pytest.raises(ValueError, match="exactly one"):
        engine.add_request("hi", prompt_ids=[1])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    assert not engine.has_unfinished and engine.pool.num_used == 0


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    # The CPU backend, whose bits are the same on every host: the reference backend's torch
    # int-pack GEMMs round differently on AVX2 and AVX-512 hosts, and a Xeon's greedy answer
    # there starts "L'Étoile".
    return Engine.from_config(EngineConfig(backend="cpu", device="cpu", kv_cache_gib=0.25))


def test_default_model_streams_paris(smollm2):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    outputs = list(smollm2.stream(messages=question, params=SamplingParams(temperature=0)))
    assert len(outputs) > 3 and not any(o.finished for o in outputs[:-1])
    text = "".join(o.text for o in outputs)
    assert "Paris" in text
    last = outputs[-1]
    assert last.finish_reason is FinishReason.STOP  # <|im_end|>
    assert last.output_token_ids[-1] in smollm2.tokenizer.stop_token_ids
    assert last.output_token_ids == tuple(t for o in outputs for t in o.token_ids)
    m = last.metrics
    assert m.ttft > 0 and m.tpot > 0 and m.tokens_per_s > 0
    assert m.num_output_tokens == len(outputs) and len(m.itl) == len(outputs) - 1
    assert smollm2.pool.num_used == 0


def test_stop_strings_are_never_emitted(smollm2):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    outputs = list(
        smollm2.stream(messages=question, params=SamplingParams(temperature=0, stop=["Paris"]))
    )
    text = "".join(o.text for o in outputs)
    assert "Par" not in text and text.startswith("The capital of France is")
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_closing_a_stream_cancels_the_request(smollm2):
    stream = smollm2.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=50))
    first = next(stream)
    stream.close()
    assert not first.finished and first.finish_reason is None  # a snapshot: it stays so
    assert not smollm2.has_unfinished and smollm2.pool.num_used == 0


def test_llm_generate_and_chat_keep_input_order():
    llm = LLM(TINY, backend="reference", num_blocks=256, block_size=4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    distinct = ["hello there", "a", "the quick brown fox jumps over the lazy dog", "zebra"]
    prompts = [*distinct, distinct[0], distinct[2]]  # repeats, but no rotation of itself
    solo = {p: llm.generate(p, params)[0].token_ids for p in distinct}
    alone = [solo[p] for p in prompts]
    rotations = [alone[k:] + alone[:k] for k in range(1, len(alone))]
    assert alone not in rotations and len(set(alone)) > 1  # order is observable
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == alone
    assert [len(r.token_ids) for r in results] == [5] * 6
    chats = [[{"role": "user", "content": c}] for c in ("hi", "what is 2 + 2?", "bye")]
    alone = [llm.chat(c, params)[0].token_ids for c in chats]
    assert len(set(alone)) == 3
    assert [r.token_ids for r in llm.chat(chats, params)] == alone


def test_padded_static_decode_path_equals_the_dynamic_one(solo):
    # cuda_graphs=True on the CPU runs the CUDA-graph path's padded static buffers eagerly:
    # padding rows (length 0, slot -1) must change nothing.
    prompts, expected = solo
    engine = make_engine(cuda_graphs=True, max_num_seqs=20)
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 8, 16, 20]
    requests = [engine.add_request(prompt_ids=p, params=GREEDY) for p in prompts]
    got = run_checked(engine)
    assert [got[r.request_id] for r in requests] == expected


def test_a_request_can_not_outgrow_the_whole_cache():
    # 8 blocks of 4 tokens: a request may hold at most 32 tokens, then it ends with "context";
    # without the cap it would be preempted and re-admitted forever.
    engine = make_engine(num_blocks=8, block_size=4)
    request = engine.add_request(
        prompt_ids=list(range(3, 13)),
        params=SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
    )
    for _ in range(100):
        if not engine.has_unfinished:
            break
        engine.step()
    assert request.finish_reason is FinishReason.CONTEXT
    assert request.num_tokens == 32 and engine.pool.num_used == 0
