"""The draft-model proposer (engine/speculative/draft.py): self:N proposes exactly the N-layer
model's own greedy continuation, catch-up after a partial acceptance equals a fresh run,
sampled proposals follow the draft_probs they return, forget / preemption restart cleanly, and
a draft that cannot serve the target is refused naming draft_model. The end-to-end tests run
through the speculative engine once its config fields exist (skipped before)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.request import Request
from pagedkern.engine.speculative.draft import DRAFT_SEED_KEY, DraftProposer
from pagedkern.model import (
    PRESETS,
    LayerWeights,
    LlamaModel,
    LlamaWeights,
    SequenceChunk,
    build_batch,
    load_model,
    synthetic_tokenizer,
)
from pagedkern.reference import rejection_sample, sample, sampling_distribution

TARGET = PRESETS["tiny"].replace(name="tiny-4", num_layers=4)
VOCAB = TARGET.vocab_size
BLOCK = 4
BLOCKS_EACH = 48  # 192 slots per request: prompt + output + k always fit
CONFIG = EngineConfig(model="synthetic:tiny", backend="reference")
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
SAMPLED = {
    "temperature 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64),
    "temperature 0.7, top-k 5": SamplingParams(temperature=0.7, top_k=5, max_tokens=64),
}


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return load_model(TARGET, "cpu", seed=3)[0]


def target_cache(target: LlamaModel, requests: int, blocks_each: int = BLOCKS_EACH):
    return target.allocate_kv_cache(requests * blocks_each, BLOCK)


def make_requests(prompts, params, seeds=None, blocks_each: int = BLOCKS_EACH) -> list[Request]:
    """Decoding requests (prompt computed by the target) with disjoint block tables."""
    requests = []
    for i, ids in enumerate(prompts):
        r = Request(f"R{i}", tuple(ids), params, seed=i if seeds is None else seeds[i])
        r.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
        r.num_computed_tokens = len(ids) - 1
        requests.append(r)
    return requests


def varied_prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 4, 5, 17, 40, 90]
    return [[rng.randrange(VOCAB) for _ in range(lengths[i % len(lengths)] + i)] for i in range(n)]


def truncated_copy(target: LlamaModel, layers: int) -> LlamaModel:
    """An independent N-layer model: cloned tensors, built here, not by the proposer."""
    w = target.weights

    def clone(layer: LayerWeights) -> LayerWeights:
        return LayerWeights(
            **{
                f.name: None if getattr(layer, f.name) is None else getattr(layer, f.name).clone()
                for f in dataclasses.fields(LayerWeights)
            }
        )

    weights = LlamaWeights(
        w.embed.clone(), [clone(x) for x in w.layers[:layers]], w.norm.clone(), w.lm_head.clone()
    )
    return LlamaModel(target.config.replace(num_layers=layers), weights)


def greedy_continuations(model: LlamaModel, prompts, tokens: int) -> list[list[int]]:
    """The model's own greedy continuation of each prompt, non-speculatively (the engine)."""
    config = EngineConfig(backend="reference", num_blocks=512, block_size=BLOCK)
    engine = Engine(model, synthetic_tokenizer(VOCAB), config)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(prompt_ids=p, params=params).request_id for p in prompts]
    out: dict[str, list[int]] = {}
    for o in engine.run_until_done():
        out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[i] for i in ids]


@pytest.mark.parametrize("layers", [1, 2, 4])
def test_self_draft_proposes_the_truncated_models_greedy_continuation(target, layers):
    prompts = varied_prompts(10)
    k = 5
    requests = make_requests(prompts, GREEDY)
    proposer = DraftProposer.create(f"self:{layers}", target, target_cache(target, 10), CONFIG)
    got = proposer.propose(requests, [k] * len(requests))
    want = greedy_continuations(truncated_copy(target, layers), prompts, k)
    assert [list(p.token_ids) for p in got] == want
    assert all(p.draft_probs is None for p in got)  # greedy: a point mass
    # The same tensors as the target's, no copies; a cache of N layers over the same blocks.
    draft = proposer.draft
    assert draft.weights.embed is target.weights.embed
    assert draft.weights.lm_head is target.weights.lm_head
    assert draft.weights.norm is target.weights.norm
    for mine, theirs in zip(draft.weights.layers, target.weights.layers[:layers]):
        assert mine is theirs
    assert draft.config.num_layers == layers
    assert proposer.kv_cache.num_layers == layers
    assert proposer.kv_cache.num_blocks == 10 * BLOCKS_EACH
    assert proposer.kv_cache.block_size == BLOCK


def accept_some(requests, proposals, k: int) -> list[int]:
    """Simulate verification: request i keeps i % (k + 1) proposals, then a token of the
    target's (a different one where a proposal was rejected). Returns the accepted counts."""
    accepted = []
    for i, (r, p) in enumerate(zip(requests, proposals)):
        a = min(i % (k + 1), len(p.token_ids))
        last = (p.token_ids[a] + 1) % VOCAB if a < len(p.token_ids) else 7
        r.output_ids += [*p.token_ids[:a], last]
        r.num_computed_tokens = r.num_tokens - 1
        accepted.append(a)
    return accepted


def assert_same_proposals(got, want, atol=1e-5):
    assert [p.token_ids for p in got] == [p.token_ids for p in want]
    for g, w in zip(got, want):
        assert (g.draft_probs is None) == (w.draft_probs is None)
        if g.draft_probs is not None:
            assert g.draft_probs.dtype == torch.float32
            assert g.draft_probs.shape == (len(g.token_ids), VOCAB)
            torch.testing.assert_close(g.draft_probs, w.draft_probs, atol=atol, rtol=0)


@pytest.mark.parametrize("draft_model", ["self:2", "synthetic:tiny"])
def test_catch_up_after_partial_acceptance_equals_a_fresh_draft_run(target, draft_model):
    k, n = 4, 12
    prompts = varied_prompts(n, seed=11)
    sampled = SAMPLED["temperature 0.7, top-p 0.9"]
    requests = make_requests(prompts, GREEDY)
    for r in requests[1::2]:
        r.params = sampled
    kv = target_cache(target, n)
    proposer = DraftProposer.create(draft_model, target, kv, CONFIG)
    for _ in range(3):  # three rounds of propose / partial acceptance
        before = [r.num_tokens for r in requests]
        proposals = proposer.propose(requests, [k] * n)
        assert all(len(p.token_ids) == k for p in proposals)
        accepted = accept_some(requests, proposals, k)
        for r, start, a in zip(requests, before, accepted):
            # What the draft cache still holds: the fed ids and the proposals that survived
            # (it fed k - 1 of them), so the next catch-up feeds only the rest.
            assert proposer._held[r.request_id].valid_prefix(r) == start + min(a, k - 1)
    # Mixed lengths, including none and one (no decode step).
    ks = [i % (k + 2) for i in range(n)]
    got = proposer.propose(requests, ks)
    fresh = DraftProposer.create(draft_model, target, kv, CONFIG).propose(requests, ks)
    assert [len(p.token_ids) for p in got] == ks
    assert_same_proposals(got, fresh)


@pytest.mark.parametrize("case", SAMPLED)
def test_sampled_proposals_follow_their_draft_probs(target, case):
    """Many seeds, one prompt: the first proposal's frequencies match draft_probs row 0; the
    second's match the sum of each request's own row 1 (conditionally on its first token the
    second is drawn from that row), by a chi-square bound."""
    draws, batch, k = 2048, 2048, 2
    prompt = [5, 77, 300, 12, 9]
    kv = target_cache(target, batch, blocks_each=2)  # 5 + 2 tokens
    proposer = DraftProposer.create("synthetic:tiny", target, kv, CONFIG)
    firsts, seconds = [], []
    row0, row1_sum = None, torch.zeros(VOCAB, dtype=torch.float64)
    for start in range(0, draws, batch):
        seeds = [start + i * 7919 for i in range(batch)]
        requests = make_requests([prompt] * batch, SAMPLED[case], seeds, blocks_each=2)
        for p in proposer.propose(requests, [k] * batch):
            firsts.append(p.token_ids[0])
            seconds.append(p.token_ids[1])
            assert p.draft_probs[0, p.token_ids[0]] > 0 and p.draft_probs[1, p.token_ids[1]] > 0
            row0 = p.draft_probs[0].double() if row0 is None else row0
            row1_sum += p.draft_probs[1].double()
        for r in requests:
            proposer.forget(r)
    assert_chi_square(torch.tensor(firsts), row0 * draws)
    assert_chi_square(torch.tensor(seconds), row1_sum)


def assert_chi_square(observed_ids: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson's statistic over cells of expectation >= 5 (the rest pooled), below its mean
    plus 6 standard deviations (df + 6 sqrt(2 df)); no draw where the expectation is 0."""
    observed = torch.bincount(observed_ids, minlength=expected.numel()).double()
    assert observed[expected == 0].sum() == 0, "drew a token the distribution excludes"
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 1
    assert stat < df + 6 * math.sqrt(2 * df), f"chi-square {stat:.1f} with {df} dof"


@pytest.mark.parametrize(
    "case, draft_model",
    # A random draft's top 5 never meets the target's (nothing accepted): top-k runs self:3.
    [("temperature 0.7, top-p 0.9", "synthetic:tiny"), ("temperature 0.7, top-k 5", "self:3")],
)
def test_verified_proposals_keep_the_target_distribution(target, case, draft_model):
    """One speculative step by the reference rule (rejection_sample) over the draft's
    proposals and draft_probs: the first verified token is distributed exactly as the target's
    own sample (the draft's draws must be independent of the rule's uniforms)."""
    draws, batch, k = 4096, 2048, 2
    params = SAMPLED[case]
    args = (params.temperature, params.top_p, params.top_k)
    prompt = [5, 77, 300, 12, 9]
    kv = target_cache(target, batch, blocks_each=2)  # 5 + 2 tokens
    proposer = DraftProposer.create(draft_model, target, kv, CONFIG)
    firsts, accepted = [], 0
    for start in range(0, draws, batch):
        seeds = list(range(start, start + batch))
        requests = make_requests([prompt] * batch, params, seeds, blocks_each=2)
        proposals = proposer.propose(requests, [k] * batch)
        chunks = [
            SequenceChunk([*prompt, *p.token_ids], 0, r.block_table)
            for r, p in zip(requests, proposals)
        ]
        ids, meta = build_batch(chunks, BLOCK)
        with torch.inference_mode():
            hidden = target.hidden_states(ids, meta, kv)
            ends = meta.cu_seqlens[1:].long()
            rows = (ends[:, None] - (k + 1) + torch.arange(k + 1)).flatten()
            target_probs = sampling_distribution(target.compute_logits(hidden[rows]), *args)
        out, num = rejection_sample(
            target_probs,
            torch.tensor([t for p in proposals for t in p.token_ids], dtype=torch.int32),
            torch.cat([p.draft_probs for p in proposals]),
            torch.arange(0, (batch + 1) * k, k, dtype=torch.int32),
            torch.tensor(seeds),
            torch.zeros(batch, dtype=torch.int64),
        )
        firsts += out[:, 0].tolist()
        accepted += int((num - 1).sum())
        for r in requests:
            proposer.forget(r)
    ids, meta = build_batch([SequenceChunk(prompt, 0, [0, 1])], BLOCK)
    p0 = sampling_distribution(target(ids, meta, target_cache(target, 1)), *args)[0]
    assert 0 < accepted < draws * k  # both branches of the rule ran
    assert_chi_square(torch.tensor(firsts), p0 * draws)


def whole_model_draft(target, params: SamplingParams, n: int):
    """A self-draft of every layer (the target itself) proposes one token for n requests of
    seeds 0 .. n-1 after one prompt: its proposals and the target's logits there (n rows)."""
    prompt = [1, 2, 3, 4]
    requests = make_requests([prompt] * n, params, seeds=list(range(n)))
    proposer = DraftProposer.create(
        f"self:{TARGET.num_layers}", target, target_cache(target, n), CONFIG
    )
    proposed = torch.tensor([p.token_ids[0] for p in proposer.propose(requests, [1] * n)])
    kv = target.allocate_kv_cache(4, BLOCK)
    ids, meta = build_batch([SequenceChunk(prompt, 0, [0, 1])], BLOCK)
    return proposed, target(ids, meta, kv).expand(n, VOCAB)


def test_draft_draws_are_not_the_targets_stream(target):
    """With the draft equal to the target (self:L), the same Philox stream would make every
    proposal the token the target samples; a distinct key agrees only by chance."""
    n = 512
    params = SAMPLED["temperature 0.7, top-p 0.9"]
    proposed, logits = whole_model_draft(target, params, n)
    own = sample(logits, params.temperature, params.top_p, params.top_k, torch.arange(n), 0)
    p = sampling_distribution(logits[:1], params.temperature, params.top_p, params.top_k)[0]
    agree = (own.long() == proposed).double().mean().item()
    chance = float((p * p).sum())
    assert agree < chance + 0.1, f"draft and target draws agree {agree:.2f} (chance {chance:.2f})"
    keyed = sample(
        logits, params.temperature, params.top_p, params.top_k, torch.arange(n) ^ DRAFT_SEED_KEY, 0
    )
    assert torch.equal(keyed.long(), proposed)  # the documented key, and sample's rule


@pytest.mark.parametrize("how", ["forget", "preempted without forget"])
def test_restart_after_preemption_is_clean(target, how):
    k = 3
    prompts = varied_prompts(4, seed=5)
    requests = make_requests(prompts, GREEDY)
    kv = target_cache(target, 4)
    proposer = DraftProposer.create("self:2", target, kv, CONFIG)
    proposals = proposer.propose(requests, [k] * 4)
    accept_some(requests, proposals, k)
    # Preemption: the blocks went back to the pool and someone else wrote them (NaN here), and
    # the request comes back on other blocks.
    victim = requests[1]
    proposer.kv_cache.data[:, :, victim.block_table] = float("nan")
    if how == "forget":
        proposer.forget(victim)
        assert victim.request_id not in proposer._held
    else:
        victim.num_preemptions += 1
    victim.block_table = victim.block_table[::-1]  # other physical blocks, same NaN content
    got = proposer.propose(requests, [k] * 4)
    fresh = DraftProposer.create("self:2", target, kv, CONFIG).propose(requests, [k] * 4)
    assert_same_proposals(got, fresh)


def test_a_new_request_under_a_reused_id_starts_over(target):
    requests = make_requests(varied_prompts(2), GREEDY)
    kv = target_cache(target, 2)
    proposer = DraftProposer.create("self:2", target, kv, CONFIG)
    proposer.propose(requests, [3, 3])
    again = make_requests([[9, 8, 7]], GREEDY)[0]  # R0 again, another prompt, same blocks
    assert proposer._held["R0"].valid_prefix(again) == 0
    got = proposer.propose([again], [3])
    assert got == DraftProposer.create("self:2", target, kv, CONFIG).propose([again], [3])


def test_nothing_asked_runs_nothing(target):
    requests = make_requests(varied_prompts(2), GREEDY)
    proposer = DraftProposer.create("self:1", target, target_cache(target, 2), CONFIG)
    proposer.kv_cache.data.fill_(float("nan"))
    got = proposer.propose(requests, [0, 0])
    assert [(p.token_ids, p.draft_probs) for p in got] == [((), None), ((), None)]
    assert torch.isnan(proposer.kv_cache.data).all(), "a zero-length proposal ran the draft"
    with pytest.raises(ValueError, match="max_tokens"):
        proposer.propose(requests, [1])


@pytest.mark.parametrize("name", ["self:0", "self:5", "self:two", "self:"])
def test_self_draft_layer_count_is_checked(target, name):
    with pytest.raises(ValueError, match=f"draft_model {name!r}.*1..4"):
        DraftProposer.create(name, target, target_cache(target, 1), CONFIG)


def test_a_draft_with_another_vocabulary_is_refused():
    small = load_model(TARGET.replace(vocab_size=300), "cpu", seed=1)[0]
    with pytest.raises(ValueError, match="draft_model 'synthetic:tiny'.*512.*300"):
        DraftProposer.create("synthetic:tiny", small, target_cache(small, 1), CONFIG)


def test_a_synthetic_draft_of_the_targets_preset_is_another_model(target):
    tiny = load_model("synthetic:tiny", "cpu", seed=CONFIG.seed)[0]
    proposer = DraftProposer.create("synthetic:tiny", tiny, target_cache(tiny, 1), CONFIG)
    assert proposer.draft is not tiny
    assert not torch.equal(proposer.draft.weights.embed, tiny.weights.embed)
    assert proposer.draft.config.vocab_size == VOCAB


# --- end to end, through spec-engine's speculative step ----------------------------------------
SPECULATIVE = "speculative" in {f.name for f in dataclasses.fields(EngineConfig)}
needs_engine = pytest.mark.skipif(
    not SPECULATIVE, reason="EngineConfig has no speculative fields yet (spec-engine's branch)"
)
TEXTS = [
    "The capital of France is",
    "Write a haiku about rain.",
    "List the first ten prime numbers:",
    "def fibonacci(n):",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "Translate 'good morning' into Spanish, French and German.",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "The following is a list of colors: red, green,",
    "Summarize: Large language models predict the next token given the previous ones.",
    "import numpy as np\nx = np.arange(10)\n",
    "Dear Sir or Madam,",
    "The mitochondria is",
    "Correct the spelling: Teh cat sat on teh mat.",
    "In 1492,",
    "A B C D E F G",
]
E2E_SCENARIOS = {
    "batched": {},
    "preemption (24-block pool)": {"num_blocks": 24},
    "chunked prefill (16-token budget)": {"max_num_batched_tokens": 16},
}


def run_all(config: EngineConfig, prompts, params) -> tuple[list[list[int]], int, int]:
    """Token ids per chat prompt (checking the pool after every step), the preemptions and the
    accepted proposals."""
    engine = Engine.from_config(config)
    ids = [
        engine.add_request(messages=[{"role": "user", "content": p}], params=params).request_id
        for p in prompts
    ]
    out: dict[str, list[int]] = {}
    preemptions = 0
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            preemptions += o.metrics.num_preemptions if o.finished else 0
        engine.pool.check_invariants(engine.scheduler.block_tables())
    assert engine.pool.num_used == 0, "blocks leaked"
    return [out[i] for i in ids], preemptions, engine.stats().num_spec_accepted


# model -> (its plain config, the self-draft, the prompts): the tiny synthetic model's one layer
# of two over half the prompts in the fast set (a pool of 256 blocks: run_all checks every block
# after each step; 9 prompts still preempt in 24 blocks and take many 16-token chunks); the
# default model (real text, where a 4-layer draft is often right) is `slow`.
SELF_DRAFT_MODELS = {
    "tiny": (EngineConfig("synthetic:tiny", backend="reference", num_blocks=256), "self:1", 9),
    "default model": (EngineConfig(backend="reference", kv_cache_gib=0.25), "self:4", 18),
}


@pytest.fixture(
    scope="module",
    params=["tiny", pytest.param("default model", marks=pytest.mark.slow)],
)
def plain_greedy(request):
    config, draft, prompts = SELF_DRAFT_MODELS[request.param]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return config, draft, params, TEXTS[:prompts], run_all(config, TEXTS[:prompts], params)[0]


@needs_engine
@pytest.mark.parametrize("scenario", E2E_SCENARIOS)
def test_greedy_with_a_self_draft_is_token_identical(plain_greedy, scenario):
    plain, draft, params, prompts, want = plain_greedy
    config = dataclasses.replace(
        plain,
        speculative="draft",
        draft_model=draft,
        num_speculative_tokens=4,
        **E2E_SCENARIOS[scenario],
    )
    got, preemptions, accepted = run_all(config, prompts, params)
    assert got == want
    assert accepted > 0, "no proposal was accepted: the accept branch did not run"
    if "num_blocks" in E2E_SCENARIOS[scenario]:
        assert preemptions > 0, "the small pool did not preempt"


def exact_first_two(model: LlamaModel, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """The non-speculative joint distribution [V, V] of the first two sampled tokens."""
    kv = model.allocate_kv_cache(2, 16)
    ids, meta = build_batch([SequenceChunk(prompt, 0, [0])], 16)
    args = (params.temperature, params.top_p, params.top_k)
    p0 = sampling_distribution(model(ids, meta, kv), *args)[0]
    firsts = p0.nonzero()[:, 0].tolist()
    kv = model.allocate_kv_cache(len(firsts), 16)
    chunks = [SequenceChunk([*prompt, t], 0, [i]) for i, t in enumerate(firsts)]
    ids, meta = build_batch(chunks, 16)
    p1 = sampling_distribution(model(ids, meta, kv), *args)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    joint[firsts] = p0[firsts, None] * p1
    return joint


# Seeds per case. The power was computed from the exact distributions of these two models (the
# chi-square's noncentrality against its bound, df + 6 sqrt(2 df)): a recovered token drawn from
# p instead of the residual (p - q)+, the subtlest wrong rule, moves the second token's marginal
# by z = 10 at 2^14 seeds (the joint over all 2^16 seeds it once took: z = 15); an always-accept
# rule or a swapped residual by z > 100. Under top-k 5 nothing is accepted and those two rules
# move it by z = 31 at 2^12 seeds.
RANDOM_DRAFT_SEEDS = {"temperature 0.7, top-p 0.9": 2**14, "temperature 0.7, top-k 5": 2**12}


@needs_engine
@pytest.mark.parametrize("case", SAMPLED)
def test_speculative_sampling_with_a_random_draft_keeps_the_distribution(case):
    """Many requests, a synthetic target and a different random synthetic draft: the first two
    tokens' joint frequencies under speculation match the exact non-speculative joint, and so
    do the second token's alone (the verified one: the sharpest test of the rule). The
    requests have no seed of their own, so they verify by the rejection rule; the engine's
    seed source is seeded here so that the run is reproducible."""
    seeds, batch = RANDOM_DRAFT_SEEDS[case], 4096
    prompt = [5]  # one token: the prefill runs as a (batched) decode row, the cheap path
    # Four tokens, so that the second one is verified (the last allowed token is only ever
    # sampled: nothing to propose for it); the first two are compared.
    params = dataclasses.replace(SAMPLED[case], max_tokens=4, ignore_eos=True)
    config = EngineConfig(
        model="synthetic:tiny",
        backend="reference",
        num_blocks=batch * 4,  # 4 + 3 lookahead tokens: 2 blocks each, no preemption
        block_size=BLOCK,
        max_num_seqs=batch,
        max_num_batched_tokens=batch * 8,
        enable_prefix_caching=False,
        speculative="draft",
        draft_model="synthetic:tiny",
        num_speculative_tokens=3,
    )
    engine = Engine.from_config(config)
    engine.admission._seeds = random.Random(17)
    pairs = []
    for start in range(0, seeds, batch):
        out: dict[str, list[int]] = {}
        for s in range(start, start + batch):
            engine.add_request(prompt_ids=prompt, params=params, request_id=f"S{s}")
        for o in engine.run_until_done():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        pairs += [tuple(ids[:2]) for ids in out.values()]
    stats = engine.stats()
    assert stats.num_spec_proposed > 0
    if params.top_k <= 0:  # a random draft's top 5 never meets the target's: all rejected there
        assert stats.num_spec_accepted > 0
    joint = exact_first_two(engine.model, prompt, params)
    observed = torch.tensor([a * VOCAB + b for a, b in pairs])
    assert_chi_square(observed, joint.flatten() * seeds)
    assert_chi_square(observed // VOCAB, joint.sum(1) * seeds)  # the first token alone
    assert_chi_square(observed % VOCAB, joint.sum(0) * seeds)  # the second, verified, alone


@needs_engine
@pytest.mark.parametrize("draft_model", ["self:1", "synthetic:tiny"])
def test_seeded_sampling_with_a_draft_is_token_identical(draft_model):
    """A request given a seed draws the tokens plain decoding draws (the coupled rule), with a
    draft of the target's own layer and with another random model, batched and preempting."""
    config, _, prompts = SELF_DRAFT_MODELS["tiny"]
    params = SamplingParams(temperature=0.3, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    want = run_all(config, TEXTS[:prompts], params)[0]
    for scenario in ("batched", "preemption (24-block pool)"):
        spec = dataclasses.replace(
            config,
            speculative="draft",
            draft_model=draft_model,
            num_speculative_tokens=4,
            **E2E_SCENARIOS[scenario],
        )
        got, preemptions, accepted = run_all(spec, TEXTS[:prompts], params)
        assert got == want, scenario
        if draft_model.startswith("self"):
            assert accepted > 0, "no proposal was accepted: the accept branch did not run"
        if "num_blocks" in E2E_SCENARIOS[scenario]:
            assert preemptions > 0, "the small pool did not preempt"


def test_a_seeded_requests_draft_draws_with_its_own_seed(target):
    """The shared uniform: a seeded request's proposal is the draft distribution's inverse CDF
    at the target's own draw (sample's rule with the request's seed), so a draft equal to the
    target proposes exactly the token the target then draws."""
    n = 256
    params = dataclasses.replace(SAMPLED["temperature 0.7, top-p 0.9"], seed=0)
    proposed, logits = whole_model_draft(target, params, n)
    own = sample(logits, params.temperature, params.top_p, params.top_k, torch.arange(n), 0)
    assert torch.equal(own.long(), proposed)


@pytest.mark.parametrize("draft_model", ["self:1", "synthetic:tiny"])
def test_the_kv_budget_holds_the_draft_cache_too(draft_model):
    # The draft's cache has as many blocks as the target's; sized from kv_cache_gib (on a GPU
    # from the memory left after the profiling pass), the two together must fit it, where the
    # target's alone once took all of it and the draft's came on top.
    gib = 2**-10
    config = EngineConfig(
        model="synthetic:tiny", backend="reference", device="cpu", kv_cache_gib=gib,
        speculative="draft", draft_model=draft_model,
    )  # fmt: skip
    engine = Engine.from_config(config)
    caches = [engine.kv_cache.data, engine.proposer.kv_cache.data]
    used = sum(c.numel() * c.element_size() for c in caches)
    per_block = used // engine.kv_cache.num_blocks
    assert engine.proposer.kv_cache.num_blocks == engine.kv_cache.num_blocks
    assert gib * 2**30 - per_block < used <= gib * 2**30
    engine.add_request(prompt_ids=[1, 2, 3], params=GREEDY)
    assert sum(len(o.token_ids) for o in engine.run_until_done()) == GREEDY.max_tokens
