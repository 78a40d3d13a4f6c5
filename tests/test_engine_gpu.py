"""The serving path on the CUDA kernels (GPU only): logits close to the fp32 reference backend,
the capital question answered with Paris, CUDA-graph decode equal to eager decode, and a mixed
batch (prefill + decode, prefix hits, preemption) equal to solo runs.

Half-precision GEMMs choose algorithms by batch size, so batched and solo runs can differ in
the last bits; greedy outputs are required to match exactly for nearly all requests and the
logits to stay close."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import (
    ModelLoadError,
    SequenceChunk,
    build_batch,
    default_model_path,
    load_model,
)

pytestmark = pytest.mark.gpu


def _default_model_missing() -> str | None:
    try:  # the GGUF (98 MB) does not fit the offline GPU box's 64 MiB carry: may be absent
        return None if default_model_path().is_file() else "the default model file is missing"
    except ModelLoadError as exc:
        return str(exc)


needs_default_model = pytest.mark.skipif(
    _default_model_missing() is not None, reason=str(_default_model_missing())
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "法国的首都是哪里？",
]


def _prompt_logits(model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    kv = model.allocate_kv_cache(-(-len(ids) // 16), 16)
    input_ids, meta = build_batch(
        [SequenceChunk(ids, 0, list(range(kv.num_blocks)))], 16, model.device, logits_rows=None
    )
    meta.logits_indices = torch.arange(len(ids), device=model.device, dtype=torch.int32)
    return model(input_ids, meta, kv)


# Seeded synthetic weights of the default model's shape: on every GPU machine, where the default
# model's GGUF may be absent (it does not fit the offline machine's carry, and gguf is not there).
SYNTHETIC, SEED = "synthetic:smollm2-135m", 3


@pytest.mark.parametrize(
    "spec, dtype",
    [
        pytest.param(None, None, marks=needs_default_model),  # fp16, as the GGUF loads on CUDA
        (SYNTHETIC, None),  # bf16
        (SYNTHETIC, torch.float16),  # the default model's dtype, without its file
    ],
)
def test_cuda_logits_match_the_fp32_reference(spec, dtype):
    fast, tokenizer = load_model(spec, "cuda", dtype, seed=SEED)  # on the kernels
    with ops.use_backend("reference"):
        exact, _ = load_model(spec, "cuda", torch.float32, seed=SEED)
        expected = [_prompt_logits(exact, tokenizer, p) for p in PROMPTS]
    agree = total = 0
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        got = _prompt_logits(fast, tokenizer, prompt)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert float(cos.min()) > 0.99, prompt
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += got.shape[0]
    assert agree / total >= 0.95


@needs_default_model
def test_capital_question_on_the_kernels():
    engine = Engine.from_config(EngineConfig(backend="cuda"))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    text = "".join(
        o.text for o in engine.stream(messages=question, params=SamplingParams(temperature=0))
    )
    assert "Paris" in text
    assert engine.pool.num_used == 0


def test_chat_on_the_kernels_follows_the_fp32_reference():
    # The chat path of the test above (template, streamed greedy text, blocks freed) on seeded
    # synthetic weights, so it runs where the default model is absent. Random weights answer
    # nothing, so the check is the tokens: fed back through the fp32 reference, each greedy
    # token is its argmax at nearly every step (bf16 rounding may flip a near tie).
    engine = Engine.from_config(
        EngineConfig(model=SYNTHETIC, seed=SEED, backend="cuda", num_blocks=1024)
    )  # num_blocks: leave the GPU's memory to the tests after this one in the process
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = list(engine.stream(messages=question, params=params))
    assert engine.pool.num_used == 0
    last = outputs[-1]
    prompt, answer = list(last.prompt_token_ids), list(last.output_token_ids)
    assert last.finished and len(answer) == 32
    assert "".join(o.text for o in outputs).strip()
    assert [t for o in outputs for t in o.token_ids] == answer
    assert prompt == engine.tokenizer.apply_chat_template(question, tokenize=True)
    [agree] = reference_argmax_agreement([(prompt, answer)], seed=SEED)
    assert agree >= len(answer) - 3


def reference_argmax_agreement(
    answers: list[tuple[list[int], list[int]]], seed: int, kv_cache_dtype: str = "auto"
) -> list[int]:
    """For each (prompt, answer): how many answer tokens are the fp32 reference model's argmax
    after the prompt and the answer's tokens before them (teacher forcing). Greedy answers of
    bf16 kernels follow it at nearly every step; a rounding difference may flip a near tie
    (random weights have many), and then the answers part while both stay greedy. A corrupted
    cache or batch does not follow it at all."""
    counts = []
    with ops.use_backend("reference"):
        exact, _ = load_model(
            SYNTHETIC, "cuda", torch.float32, seed=seed, kv_cache_dtype=kv_cache_dtype
        )
        for prompt, answer in answers:
            ids = prompt + answer
            kv = exact.allocate_kv_cache(-(-len(ids) // 16), 16)
            input_ids, meta = build_batch(
                [SequenceChunk(ids, 0, list(range(kv.num_blocks)))], 16, exact.device,
                logits_rows=None,
            )  # fmt: skip
            meta.logits_indices = torch.arange(len(ids), device=exact.device, dtype=torch.int32)
            predicted = exact(input_ids, meta, kv)[len(prompt) - 1 : -1].argmax(-1).tolist()
            counts.append(sum(p == a for p, a in zip(predicted, answer, strict=True)))
    return counts


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        engine.pool.check_invariants(engine.scheduler.block_tables())
    assert engine.pool.num_used == 0
    return requests


def _prompts(n: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 40000) for _ in range(shared)]
    return [
        prefix + [rng.randrange(10, 40000) for _ in range(rng.randint(5, 300))] for _ in range(n)
    ]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_cuda_graph_decode_equals_eager_decode():
    prompts = _prompts(12)
    base = dict(
        model="synthetic:smollm2-135m",
        backend="cuda",
        num_blocks=2048,
        max_num_seqs=16,
        max_model_len=2048,
    )
    graphs = Engine.from_config(EngineConfig(**base, cuda_graphs=True))
    assert graphs.runner.graphs is not None and graphs.runner.graphs._graphs
    with_graphs = [r.output_ids for r in _run(graphs, prompts, GREEDY)]
    del graphs
    eager_engine = Engine.from_config(EngineConfig(**base, cuda_graphs=False))
    eager = [r.output_ids for r in _run(eager_engine, prompts, GREEDY)]
    same = sum(a == b for a, b in zip(with_graphs, eager, strict=True))
    assert same >= len(prompts) - 1


def test_mixed_batch_with_prefix_hits_and_preemption_matches_solo():
    prompts = _prompts(16, shared=64, seed=1)
    base = dict(model="synthetic:smollm2-135m", backend="cuda", max_model_len=1024, max_num_seqs=16)
    solo_engine = Engine.from_config(EngineConfig(**base, num_blocks=512))
    solo = [_run(solo_engine, [p], GREEDY)[0].output_ids for p in prompts]
    del solo_engine
    tight = Engine.from_config(EngineConfig(**base, num_blocks=80, max_num_batched_tokens=128))
    batched = _run(tight, prompts, GREEDY)
    assert tight.pool.hit_rate > 0
    assert sum(r.num_preemptions for r in batched) > 0
    # Batched steps run other GEMM shapes than solo ones, so a near tie may flip and the two
    # greedy answers part (the H200: 13 of 16 equal, 15 or 16 on an older schedule; all 16 in
    # fp32 on the CPU). What must hold: most are equal, and every batched answer is greedy
    # under the fp32 reference at nearly every step, which a wrong block, prefix hit or resumed
    # cache would break.
    same = sum(r.output_ids == s for r, s in zip(batched, solo, strict=True))
    assert same >= len(prompts) // 2
    # (bf16 answers on this CPU follow it at 97% of tokens, 22 of 24 at worst; the same answers
    # after a corrupted prompt, at 17%.)
    answers = [(list(p), list(r.output_ids)) for p, r in zip(prompts, batched, strict=True)]
    agree = sum(reference_argmax_agreement(answers, seed=0))
    assert agree >= 0.9 * sum(len(a) for _, a in answers)
