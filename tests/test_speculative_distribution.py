"""Speculative sampling leaves the output distribution unchanged: on a synthetic model with a
32-token vocabulary, the first two generated tokens over 2^14 seeds, the second one verified
against n-gram proposals (verify.py, the reference rejection rule, verification rows through the
paged decode path), follow the exact non-speculative joint distribution
P(t1) * P(t2 | t1) (reference.sampling_distribution, what `sample` draws from): chi-square
goodness of fit, for temperature 0.7 with top-p 0.9 and with top-k 5. The same statistic
rejects an always-accept rule, so the test has the power to see a wrong rule."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkern import reference
from pagedkern.engine import SamplingParams
from pagedkern.engine.logits_processing import LogitsState
from pagedkern.engine.request import Request
from pagedkern.engine.speculative.ngram import NgramProposer
from pagedkern.engine.speculative.verify import verify
from pagedkern.model import PRESETS, LlamaModel, SequenceChunk, build_batch, synthetic_weights
from pagedkern.model.attention_metadata import verification_rows

VOCAB = 32
# A true rule fails the p > 1e-4 bound with probability 1e-4 per case at any sample size; at 2^14
# seeds (a quarter of the 2^16 it once took) the always-accept rule's p-value still underflows to
# 0 in both cases (measured), against the 1e-12 it must stay below.
NUM_SEEDS = 2**14
K = 3
BLOCK = 8


@pytest.fixture(scope="module")
def model():
    config = PRESETS["tiny"].replace(name="tiny-v32", vocab_size=VOCAB)
    return LlamaModel(config, synthetic_weights(config, "cpu", torch.float32, seed=11))


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square; cells expecting < 5 are pooled into one."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)]).double()
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # a cell of probability zero was drawn
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=2),
    ],
    ids=["temp0.7-top_p0.9", "temp0.7-top_k5"],
)
def test_first_two_tokens_follow_the_non_speculative_distribution(model, params):
    rng = random.Random(5)
    prompt = list(range(VOCAB)) + [rng.randrange(VOCAB) for _ in range(16)]
    rng.shuffle(prompt)  # every token occurs: lookup always finds the first token again
    length = len(prompt)
    table = list(range(-(-(length + K + 1) // BLOCK)))
    kv = model.allocate_kv_cache(len(table), BLOCK)
    ids, meta = build_batch([SequenceChunk(prompt, 0, table)], BLOCK)
    first_logits = model(ids, meta, kv)[-1:]

    def distribution(logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        return reference.sampling_distribution(
            logits, [params.temperature] * rows, [params.top_p] * rows, [params.top_k] * rows
        )

    seeds = torch.arange(NUM_SEEDS, dtype=torch.int64) * 7919 + 13
    first = reference.sample(
        first_logits.expand(NUM_SEEDS, -1),
        params.temperature,
        params.top_p,
        params.top_k,
        seeds,
        offsets=0,
    ).long()
    p_first = distribution(first_logits)[0]
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    always_accept = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    proposer = NgramProposer(1, 2)
    accepted_runs = 0
    for t1 in range(VOCAB):
        group = torch.nonzero(first == t1).flatten()
        if p_first[t1] == 0:
            assert group.numel() == 0
            continue
        probe = Request("probe", tuple(prompt), params, output_ids=[t1])
        (proposal,) = proposer.propose([probe], [K])
        assert len(proposal.token_ids) >= 1
        chunk = SequenceChunk([t1, *proposal.token_ids], length, table)
        ids, meta = build_batch(verification_rows(chunk), BLOCK)
        logits = model(ids, meta, kv)  # [1 + k, V]: position j verifies proposal j
        joint[t1] = p_first[t1] * distribution(logits[:1])[0]
        if group.numel() == 0:
            continue
        requests = []
        for seed in seeds[group].tolist():
            r = Request("r", tuple(prompt), params, output_ids=[t1], seed=seed)
            r.logits_state = LogitsState(params, r.prompt_ids, (), VOCAB)
            requests.append(r)
        n = len(requests)
        rows = logits.repeat(n, 1)  # request b's rows b*(k+1) .. b*(k+1)+k
        gains = verify(rows, requests, [proposal] * n)
        for gained in gains:
            counts[t1, gained[0]] += 1
            accepted_runs += len(gained) > 1
        always_accept[t1, proposal.token_ids[0]] += n
    assert abs(float(joint.sum()) - 1) < 1e-9
    expected = joint.flatten() * NUM_SEEDS
    assert accepted_runs > NUM_SEEDS // 50, "too few acceptances to test the accept branch"
    assert chi_square_p(counts.flatten(), expected) > 1e-4
    assert chi_square_p(always_accept.flatten(), expected) < 1e-12  # the test sees a bad rule
