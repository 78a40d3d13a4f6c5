"""Non-finite logits (an activation past its dtype's range, here a NaN embedding row): the
request whose hidden state overflowed fails with an error saying so, instead of emitting the
token a sampler draws from NaN (id 0: an EOS on many models, so a silently empty answer); the
requests beside it run on unchanged, and the KV blocks it held serve the next requests right."""

from __future__ import annotations

import pytest
import torch

from pagedkern.engine import Engine, EngineConfig, FinishReason, SamplingParams

POISON = 7  # the token whose embedding row is NaN
PROMPTS = {"clean": [1, 2, 3, 4, 5, 6], "poisoned": [1, 2, POISON, 4], "later": [9, 10, 11] * 5}


def make_engine(backend: str, async_scheduling: bool) -> Engine:
    config = EngineConfig(
        model="synthetic:tiny",
        backend=backend,
        num_blocks=16,  # few: the later request reuses the poisoned one's blocks
        block_size=4,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    return Engine.from_config(config)


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for rid, ids in prompts.items():
        engine.add_request(prompt_ids=ids, params=params, request_id=rid)
    got: dict[str, list] = {}
    for out in engine.run_until_done():
        tokens, _ = got.get(out.request_id, ([], None))
        got[out.request_id] = (tokens + list(out.token_ids), out if out.finished else None)
    assert engine.pool.num_used == 0
    return got


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_nan_hidden_state_fails_its_request_alone(backend, async_scheduling, temperature):
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=5, ignore_eos=True)
    want = run(make_engine(backend, False), {k: PROMPTS[k] for k in ("clean", "later")}, params)
    engine = make_engine(backend, async_scheduling)
    with torch.no_grad():
        engine.model.weights.embed[POISON] = float("nan")
    got = run(engine, {k: PROMPTS[k] for k in ("clean", "poisoned")}, params)
    tokens, final = got["poisoned"]
    assert tokens == [] and final.finish_reason is FinishReason.ERROR
    assert "NaN or infinite" in final.error
    assert got["clean"][0] == want["clean"][0] and len(want["clean"][0]) == 6
    assert got["clean"][1].finish_reason is FinishReason.LENGTH
    # the poisoned request's blocks (NaN K/V in them) are reused: nothing of them leaks
    later = run(engine, {"later": PROMPTS["later"]}, params)
    assert later["later"][0] == want["later"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["host", "device-path"])
def test_the_drawn_ids_mark_non_finite_rows(dtype):
    """checked_ids on both of its paths (the device one runs for any logits but fp32
    on the host, so a CPU run covers it): NON_FINITE exactly where the drawn logit is NaN or
    infinite, the drawn id elsewhere (a -inf logit elsewhere in the row does not count)."""
    from pagedkern.engine.non_finite import NON_FINITE, checked_ids

    logits = torch.randn(5, 11).to(dtype)
    logits[1] = float("nan")
    logits[2, 4] = float("inf")
    logits[3, 0] = float("-inf")
    ids = torch.tensor([3, 6, 4, 7, 0], dtype=torch.int32)
    logits[4, 0] = float("-inf")
    assert checked_ids(ids, logits) == [3, NON_FINITE, NON_FINITE, 7, NON_FINITE]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_proposals_that_overflow_change_nothing(temperature):
    """Speculation with a proposer that proposes the poisoned token: the verification rows after
    it are NaN, but a proposal is kept only where the finite row before it drew it, so the
    output is the plain one (seeded: the coupled rule), and the request beside it runs on."""
    from pagedkern.engine.speculative import Proposal

    class Poison:
        def propose(self, requests, max_tokens):
            return [Proposal((POISON, 1, 2)[:k]) for k in max_tokens]

        def forget(self, request):
            pass

    config = EngineConfig(
        model="synthetic:tiny", backend="reference", num_blocks=32, block_size=4,
        speculative="ngram", num_speculative_tokens=3,
    )  # fmt: skip
    engine = Engine.from_config(config)
    with torch.no_grad():
        engine.model.weights.embed[POISON] = float("nan")
    engine.proposer = Poison()
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=5, ignore_eos=True)
    prompts = {"clean": PROMPTS["clean"], "other": [1, 2, 3, 4]}
    got = run(engine, prompts, params)
    want = run(make_engine("reference", False), prompts, params)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    assert engine.stats().num_spec_proposed > 0


def test_a_verified_run_through_a_non_finite_row_is_marked():
    """checked_gains: a request whose gained tokens include one drawn from a row whose logit
    for it is not finite gains [NON_FINITE]; the others keep their gains."""
    from pagedkern.engine.non_finite import NON_FINITE, checked_gains
    from pagedkern.engine.speculative import Proposal

    proposals = [Proposal((4, 5)), Proposal(()), Proposal((6,))]
    logits = torch.randn(3 + 1 + 2, 9)
    logits[2] = float("nan")  # request 0's third row: its bonus token's
    logits[5, 1] = float("inf")  # request 2's second row, at a token it did not gain
    gains = [[4, 5, 8], [2], [6, 3]]
    assert checked_gains(gains, proposals, logits) == [[NON_FINITE], [2], [6, 3]]
    assert checked_gains([[4, 7], [2], [6, 3]], proposals, logits) == [[4, 7], [2], [6, 3]]
