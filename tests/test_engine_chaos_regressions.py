"""Regressions the randomized workloads of test_engine_chaos_surfaces.py found: each a
minimal deterministic run of what a seed's workload did, failing before its fix in
pagedkern/engine (the seeds of that file's fast set fail before them too)."""

from __future__ import annotations

import dataclasses

import pytest
from test_engine_chaos_surfaces import HYBRID_LAYERS, TINY, TINY_NAME, make_engine

from pagedkern.engine import FinishReason, SamplingParams
from pagedkern.engine.outputs import TokenDeltas
from pagedkern.model import ModelConfig
from pagedkern.model.config import SLIDING


@pytest.mark.parametrize(
    "model",
    [
        TINY.replace(name="hybrid", num_layers=3, sliding_window=6, layer_types=HYBRID_LAYERS[1]),
        TINY.replace(name="sliding", sliding_window=6, layer_types=(SLIDING, SLIDING)),
        TINY.replace(
            name="moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            dense_layers=(1,),
        ),
    ],
    ids=["hybrid", "sliding", "moe-dense-layer"],
)
def test_a_self_draft_of_a_model_with_per_layer_settings(model: ModelConfig) -> None:
    """self:N keeps the target's first N layers: its config kept the target's per-layer
    layer_types and dense_layers, which a ModelConfig of N layers refuses (the engine did not
    start). Greedy output stays the plain one."""
    config = dict(model=TINY_NAME, backend="reference", device="cpu", num_blocks=64)
    config |= dict(block_size=4, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11, 12]
    tokens = []
    for spec in ({}, dict(speculative="draft", draft_model="self:1", num_speculative_tokens=3)):
        engine = make_engine(model, config | spec)
        engine.add_request(prompt_ids=prompt, params=params, request_id="q")
        tokens.append([t for out in engine.run_until_done() for t in out.token_ids])
    assert engine.stats().num_spec_proposed > 0
    assert tokens[1] == tokens[0] and len(tokens[0]) == 12


def test_an_abort_carries_the_outputs_a_stream_set_aside() -> None:
    """A stream sets the other requests' outputs aside for the next step(); abort() of one of
    them returned its final ABORT output, and the next step() then returned its older outputs
    after it. The ABORT output now carries their tokens, and nothing of it comes later."""
    config = dict(model=TINY_NAME, backend="reference", device="cpu", num_blocks=64)
    engine = make_engine(None, config)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(prompt_ids=[5, 6, 7], params=params, request_id="b")
    stream = engine.stream(prompt_ids=[9, 10, 11], params=params, request_id="a")
    assert [len(next(stream).token_ids) for _ in range(3)] == [1, 1, 1]
    final = engine.abort("b")
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert len(final.output_token_ids) == 3 and final.token_ids == final.output_token_ids
    assert [lp.token_id for lp in final.logprobs] == list(final.token_ids)
    later = [out.request_id for out in engine.step() + engine.pop_undelivered()]
    assert "b" not in later and "a" in later
    stream.close()


def test_forked_samples_at_tensor_parallel_2_share_the_whole_prompt() -> None:
    """An n > 1 fork copied the leader's partial last prompt block into the sample's own block
    on rank 0's cache shard alone (the workers only run forwards): the other ranks' heads read
    stale K/V there and a greedy sample went its own way from its second token. Now such a
    sample recomputes its prompt under tensor parallelism; greedy samples agree."""
    config = dict(model=TINY_NAME, device="cpu", num_blocks=32, block_size=4)
    config |= dict(tensor_parallel_size=2, dtype="float32", kv_cache_dtype="float32")
    params = SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True)
    engine = make_engine(None, config)
    try:
        for length in (10, 12):  # ending inside a block, and on a block's end
            engine.add_request(prompt_ids=list(range(3, 3 + length)), params=params)
            samples: dict[str, list[int]] = {}
            for out in engine.run_until_done():
                samples.setdefault(out.request_id, []).extend(out.token_ids)
            assert len(samples) == 3 and len({tuple(s) for s in samples.values()}) == 1, samples
    finally:
        engine.close()


def test_a_steps_columns_never_run_ahead_of_its_outputs() -> None:
    """The engine core sends a step's TokenDeltas columns with its outputs, and the client
    applies the columns first. Under async scheduling a step that must run synchronously (a
    penalised request joins) first completes the step in flight, then runs its own batch: a
    request's first token came out of the one as an output and its second out of the other as
    a column, which the client then read first. A request's tokens now come in order."""
    config = dict(model=TINY_NAME, backend="reference", device="cpu", async_scheduling=True)
    engine = make_engine(None, config | dict(num_blocks=64, block_size=4))
    engine.detokenize, engine.token_deltas = False, TokenDeltas()
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request(prompt_ids=[5, 6, 7], params=plain, request_id="a")
    tokens: dict[str, list[int]] = {}
    finals: dict[str, tuple[int, ...]] = {}
    while engine.has_unfinished:
        outputs = engine.step()
        if "s" not in tokens:  # after the first step: needs the host's state every step
            penalised = dataclasses.replace(plain, presence_penalty=1.0)
            engine.add_request(prompt_ids=[9, 10, 11], params=penalised, request_id="s")
            tokens["s"] = []
        for rid, token in zip(*engine.token_deltas.take(), strict=True):
            tokens.setdefault(rid, []).append(token)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            finals |= {out.request_id: out.output_token_ids} if out.finished else {}
    assert {rid: tuple(t) for rid, t in tokens.items()} == finals
