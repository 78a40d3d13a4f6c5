"""Logits processing and n > 1 through the engine on the CPU (synthetic tiny model, reference
backend): each parameter changes greedy output exactly as stated, n samples equal n separately
seeded requests while sharing the prompt's KV blocks, pool invariants hold after every step and
every block is freed exactly once."""

from __future__ import annotations

import pytest
import torch
from test_engine import make_engine, run_checked
from test_logits_processing import _expected

from pagedkern.engine import SamplingParams

PROMPT = list(range(3, 13))  # 10 tokens: 2 full blocks of 4 and a partial one


def _outputs(engine, params, prompt=PROMPT):
    engine.add_request(prompt_ids=prompt, params=params)
    return run_checked(engine)


@pytest.mark.parametrize("prompt_len", [10, 8])  # with and without a partial last block
# plenty of blocks / preemption / no free block for some samples' copies at the fork
@pytest.mark.parametrize("overrides", [{}, {"num_blocks": 14}, {"num_blocks": 5}])
def test_n_samples_equal_separately_seeded_requests(prompt_len, overrides):
    prompt = PROMPT[:prompt_len]
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=123, n=4, ignore_eos=True)
    engine = make_engine(**overrides)
    engine.add_request(prompt_ids=prompt, params=params, request_id="q")
    forked = {}
    while engine.has_unfinished:
        for out in engine.step():
            forked.setdefault(out.request_id, []).extend(out.token_ids)
            assert out.parent_id == "q" and out.request_id == (
                "q" if out.index == 0 else f"q.{out.index}"
            )
        engine.pool.check_invariants(engine.scheduler.block_tables())
        if engine.iteration == 1 and overrides.get("num_blocks") == 5 and prompt_len == 10:
            assert len(engine.scheduler.waiting) >= 1, "a sample without a block waits"
        if engine.iteration == 1 and not overrides:
            # after the prefill: the samples share the full blocks, each has its own last one
            tables = [r.block_table for r in engine.scheduler.running]
            assert len(tables) == 4
            full = prompt_len // 4
            assert all(t[:full] == tables[0][:full] for t in tables)
            if prompt_len % 4:
                assert len({t[full] for t in tables}) == 4, "the partial block is copied"
            assert engine.stats().num_prompt_tokens == prompt_len, "prompt prefilled once"
    assert engine.pool.num_used == 0
    for i in range(4):
        alone = _outputs(
            make_engine(),
            SamplingParams(max_tokens=9, temperature=1.0, seed=123 + i, ignore_eos=True),
            prompt,
        )
        assert forked["q" if i == 0 else f"q.{i}"] == next(iter(alone.values()))
    assert len({tuple(v) for v in forked.values()}) > 1, "the samples differ"


def test_aborting_an_n_request_ends_all_its_samples():
    engine = make_engine()
    # ignore_eos: a sample that drew EOS as its first token (unseeded: ~0.5% of runs) would have
    # finished with the first step, before the abort
    params = SamplingParams(n=3, max_tokens=50, ignore_eos=True)
    engine.add_request(prompt_ids=PROMPT, params=params, request_id="a")
    engine.step()
    engine.abort("a")
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished} >= {"a.1", "a.2"}
    assert not engine.has_unfinished and engine.pool.num_used == 0


def _greedy(engine, **kw):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **kw)
    return next(iter(_outputs(engine, params).values()))


def test_each_parameter_changes_greedy_output_as_stated():
    engine = make_engine()
    assert _greedy(engine, logit_bias={77: 100.0}) == [77] * 8
    # a token may not complete the bad word (77, 77): 77 alternates with the runner-up 78
    assert _greedy(engine, logit_bias={77: 100.0, 78: 99.0}, bad_words=[[77, 77]]) == [77, 78] * 4
    assert 77 not in _greedy(engine, logit_bias={77: 100.0}, bad_words=[[77]])
    allowed = [5, 50, 300]
    assert set(_greedy(engine, allowed_token_ids=allowed)) <= set(allowed)
    # min_tokens: the stop id is masked for the first 3 tokens, then taken at once
    params = SamplingParams(
        max_tokens=8, temperature=0, stop_token_ids=[77], logit_bias={77: 100.0}, min_tokens=3
    )
    out = next(iter(_outputs(engine, params).values()))
    assert len(out) == 4 and out[-1] == 77 and 77 not in out[:3]


def test_penalties_follow_the_float64_formulation_step_by_step():
    """Greedy under all three penalties and a bias: each step's token is the float64 argmax of
    that step's raw logits processed from scratch (counts recounted from the output so far)."""
    engine = make_engine()
    seen = []
    real = engine.runner.sample

    def spy(logits, requests):
        seen.append((logits[0].clone(), list(requests[0].output_ids)))
        return real(logits, requests)

    engine.runner.sample = spy
    bias = {77: 4.0, 78: 3.5, 5: -2.0}
    params = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=0.8,
        repetition_penalty=1.7,
        logit_bias=bias,
    )
    out = next(iter(_outputs(engine, params).values()))
    assert len(seen) == len(out)
    for (logits, before), token in zip(seen, out, strict=True):
        penalised = set(PROMPT) | set(before)
        entries = [
            (t, before.count(t) if t in penalised else -1, bias.get(t, 0.0))
            for t in penalised | set(bias)
        ]
        x = _expected(logits, entries, 1.5, 0.8, 1.7)
        assert token == max(range(len(x)), key=lambda t: (x[t], -t))
    assert len(set(out)) > 2, "the penalties moved greedy off its first choices"


def test_engine_logprobs_under_greedy():
    engine = make_engine()
    engine.add_request(
        prompt_ids=PROMPT,
        params=SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True),
    )
    tokens, logprobs = [], []
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.token_ids
            logprobs += out.logprobs
    assert [lp.token_id for lp in logprobs] == tokens
    for lp in logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0] == (lp.token_id, lp.logprob), "greedy: top-1 is the sampled token"
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"\u0665": 1}}, "logit_bias"),  # a digit, not an ASCII one
        ({"logit_bias": {" 5": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # (int() refuses 4300+ digits)
        ({"temperature": 2**1100}, "temperature"),  # past float's range
        ({"top_k": 2**1100}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"bad_words": [[]]}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_token_ids_are_rejected_at_admission():
    engine = make_engine()
    vocab = engine.vocab_size
    for kw, field in [
        ({"logit_bias": {vocab: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
        ({"bad_words": [[1, vocab + 5]]}, "bad_words"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.add_request(prompt_ids=PROMPT, params=SamplingParams(**kw))
    assert not engine.has_unfinished


def test_llm_generate_returns_every_sample_with_logprobs():
    from pagedkern.engine import LLM

    llm = LLM.__new__(LLM)
    llm.engine = make_engine()
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=9, n=3, logprobs=1, ignore_eos=True)
    [gen] = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(gen.samples) == 3 and gen.samples[0].token_ids == gen.token_ids
    for sample in gen.samples:
        assert len(sample.token_ids) == 4 and len(sample.logprobs) == 4
        assert [lp.token_id for lp in sample.logprobs] == list(sample.token_ids)
    assert llm.engine.pool.num_used == 0


def test_stop_strings_are_held_back_until_min_tokens():
    # Token 77 every step (bias); the stop string is its text, so without min_tokens the first
    # token ends the request. With min_tokens=4 the three earlier occurrences do not count: the
    # request ends on the 4th token, by the stop string, with the text of the first three.
    engine = make_engine()
    stop = engine.tokenizer.decode([77])
    assert stop
    for min_tokens, length in ((0, 1), (4, 4)):
        params = SamplingParams(
            max_tokens=8, temperature=0, logit_bias={77: 100.0}, stop=[stop], min_tokens=min_tokens
        )
        engine.add_request(prompt_ids=PROMPT, params=params)
        outs = []
        while engine.has_unfinished:
            outs += engine.step()
        tokens = [t for o in outs for t in o.token_ids]
        assert tokens == [77] * length
        assert outs[-1].finish_reason.value == "stop"
        assert "".join(o.text for o in outs) == stop * (length - 1)


def _full_forward_log_softmax(engine, ids):
    """float64 log-softmax of every position's logits from one dense forward of `ids` on a
    scratch cache (not the engine's paged one)."""
    from pagedkern.model import SequenceChunk, build_batch

    model = engine.model
    blocks = -(-len(ids) // 4)
    kv = model.allocate_kv_cache(blocks, 4)
    input_ids, meta = build_batch([SequenceChunk(ids, 0, list(range(blocks)))], 4)
    logits = model.compute_logits(model.hidden_states(input_ids, meta, kv))
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("budget", [512, 7])  # one prefill chunk, or chunks of 7 tokens
def test_prompt_logprobs_equal_the_float64_log_softmax_of_a_full_forward(budget):
    engine = make_engine(max_num_batched_tokens=budget)
    prompt = [3 + (i * 37) % 400 for i in range(23)]
    # a request with the same prompt first: its blocks are in the prefix cache, which the
    # prompt-logprobs request must not use (every position is computed)
    _outputs(engine, SamplingParams(max_tokens=2, temperature=0), prompt)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4, ignore_eos=True)
    engine.add_request(prompt_ids=prompt, params=params)
    finals = []
    while engine.has_unfinished:
        finals += [o for o in engine.step() if o.finished]
        engine.pool.check_invariants(engine.scheduler.block_tables())
    (out,) = finals
    want = _full_forward_log_softmax(engine, prompt)
    table = out.prompt_logprobs
    assert len(table) == len(prompt) and table[0] is None
    for p in range(1, len(prompt)):
        entry = table[p]
        assert entry.token_id == prompt[p]
        assert abs(entry.logprob - float(want[p - 1, prompt[p]])) < 1e-4
        top_ids = [t for t, _ in entry.top]
        assert top_ids == want[p - 1].argsort(descending=True, stable=True)[:4].tolist()
        for t, v in entry.top:
            assert abs(v - float(want[p - 1, t])) < 1e-4
    assert engine.pool.num_used == 0
