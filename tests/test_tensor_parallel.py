"""Tensor parallelism on the CPU (gloo, loopback): TP = N gives TP = 1's tokens, logits (within
LOGITS_ATOL) and, per rank, its heads' slice of TP = 1's KV cache (the same block ids and
slots; values within LOGITS_ATOL + KV_RTOL relative).

One TP group per model (module-scoped): tiny at TP = 2 (KV heads split 2 -> 1 per rank), an HF
folder with 6 query heads and 1 KV head at TP = 3 (KV replicated, biases, uneven vocabulary
shards), the default model (SmolLM2-135M GGUF, 9/3 heads, in fp32) at 3 (`slow`), and a tiny
Gemma 2 (test_model_gemma's) at 2; tiny again over a float16 cache.
"""

from __future__ import annotations

import pytest
import torch
from tensor_parallel_cases import (
    KV_RTOL,
    LOGITS_ATOL,
    SETTINGS,
    greedy,
    mqa_folder,
    prompts,
    record_logits,
    sampled,
)

from pagedkern.engine import LLM, SamplingParams
from pagedkern.model import PRESETS, load_model
from pagedkern.model.quantized_linear import quantize
from pagedkern.model.weight_quantization import quantize_weights
from pagedkern.parallel import TensorParallelConfigError, shard_weights
from pagedkern.parallel.shard import kv_heads_of_rank

CASES = {
    "tiny-tp2": ("synthetic:tiny", 2),
    "mqa-tp3": ("mqa", 3),
    "smollm2-tp3": (None, 3),
    "gemma2-tp2": ("gemma2", 2),  # sandwich norms, soft-caps and windows on each rank's heads
    "tiny-tp2-float16-kv": ("synthetic:tiny", 2),  # a 16-bit cache under fp32 activations
}
# fp32 weights for the default model too: its CPU int4 GEMM runs bf16 activations, whose output
# rounding TP moves (each rank rounds its partial sum), so only fp32 can match token for token.


# The default model's case (~15 s a test on two cores) is slow: the others shard heads the same
# ways (tiny-tp2 splits KV heads, mqa-tp3 replicates one over three ranks); only a GGUF's own
# weights are sharded nowhere else, and CI runs it.
@pytest.fixture(
    scope="module",
    params=[pytest.param(c, marks=pytest.mark.slow) if "smollm2" in c else c for c in CASES],
)
def engines(request, tmp_path_factory):
    spec, size = CASES[request.param]
    if spec == "mqa":
        spec = mqa_folder(tmp_path_factory.mktemp("mqa"))
    elif spec == "gemma2":
        from hf_model_files import write_tokenizer
        from test_model_gemma import _hf_model

        folder = tmp_path_factory.mktemp("gemma2")
        _hf_model("gemma2").save_pretrained(folder, safe_serialization=True)
        write_tokenizer(folder)
        spec = str(folder)
    kv = "float16" if request.param.endswith("float16-kv") else "float32"
    settings = dict(SETTINGS, quantization="none", kv_cache_dtype=kv)
    # TP runs one block table for all layers: so does its reference (same blocks, same slots)
    reference = LLM(spec, kv_per_kind_tables=False, **settings)
    assert reference.engine.kv_cache.data.dtype == (
        torch.float16 if kv == "float16" else torch.float32
    )
    with LLM(spec, tensor_parallel_size=size, **settings) as parallel:
        yield reference, parallel, size


def _run(llm, ids, params):
    steps = record_logits(llm)
    out = llm.generate(ids, params, use_tqdm=False)
    llm.engine.runner.run = type(llm.engine.runner).run.__get__(llm.engine.runner)
    assert all(g.error is None for g in out), [g.error for g in out]
    return out, steps


def test_greedy_logits_and_kv_shards_match_tp1(engines):
    reference, parallel, size = engines
    ids = prompts(reference.engine.vocab_size)
    want, want_logits = _run(reference, ids, greedy())
    got, got_logits = _run(parallel, ids, greedy())
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    # The workload did preempt, hit the prefix cache and chunk prefills, on both engines.
    assert sum(g.metrics.num_preemptions for g in got) > 0
    assert parallel.engine.stats().prefix_cache_hits > 0
    assert len(got_logits) == len(want_logits) > len(ids)
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits, strict=True))
    assert worst <= LOGITS_ATOL, worst
    # Each rank's cache: its KV heads of TP = 1's cache (same block ids, same slots).
    full = reference.engine.kv_cache.data
    caches = parallel.engine.model.tp.gather_kv_caches(parallel.engine.kv_cache.data)
    config = reference.engine.model.config
    for rank, cache in enumerate(caches):
        heads = list(kv_heads_of_rank(config, rank, size))
        assert cache.shape[3] == len(heads) and cache.dtype == full.dtype
        assert cache.abs().sum() > 0
        # (a 16-bit cache: a value TP's fp32 sums move across a rounding boundary is one unit)
        rtol = max(KV_RTOL, torch.finfo(cache.dtype).eps)
        torch.testing.assert_close(cache, full[:, :, :, heads], atol=LOGITS_ATOL, rtol=rtol)


def test_seeded_sampling_matches_tp1(engines):
    reference, parallel, _ = engines
    ids = prompts(reference.engine.vocab_size)
    want, _ = _run(reference, ids, sampled(len(ids)))
    got, _ = _run(parallel, ids, sampled(len(ids)))
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert len({g.token_ids for g in got}) > 1


def _prompt_logprobs(engine, ids: list[list[int]]) -> list[tuple]:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    wanted = [engine.add_request(prompt_ids=p, params=params).request_id for p in ids]
    finals = {o.request_id: o for o in engine.run_until_done() if o.finished}
    return [finals[request_id].prompt_logprobs for request_id in wanted]


def test_prompt_logprobs_match_tp1(engines):
    """The prompt rows' LM head runs with the sampled rows' (one gather under TP): TP = 1's
    prompt logprobs, chunked prefills included (the budget cuts the long prompts)."""
    reference, parallel, _ = engines
    ids = prompts(reference.engine.vocab_size)[:4]
    want = _prompt_logprobs(reference.engine, ids)
    got = _prompt_logprobs(parallel.engine, ids)
    assert max(map(len, ids)) > SETTINGS["max_num_batched_tokens"]
    for table, other, prompt in zip(got, want, ids, strict=True):
        assert len(table) == len(prompt) and table[0] is None and all(table[1:])
        for entry, expected, token in zip(table[1:], other[1:], prompt[1:], strict=True):
            assert entry.token_id == expected.token_id == token
            assert abs(entry.logprob - expected.logprob) <= LOGITS_ATOL
            assert [t for t, _ in entry.top] == [t for t, _ in expected.top]


# --- without processes ---------------------------------------------------------------------------
def test_sizes_the_heads_do_not_divide_are_refused_before_spawning():
    with pytest.raises(TensorParallelConfigError, match="does not divide tiny's 4 query heads"):
        LLM("synthetic:tiny", tensor_parallel_size=3, num_blocks=8)
    config = PRESETS["tiny"].replace(name="odd", num_heads=6, num_kv_heads=3)
    model, _ = load_model(config)
    with pytest.raises(TensorParallelConfigError, match="3 KV heads: one must divide"):
        shard_weights(model.weights, config, 0, 2)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_shards_are_slices_of_the_dequantized_weight(mode):
    config = PRESETS["tiny"].replace(intermediate_size=128)
    model, _ = load_model(config)
    weights = quantize_weights(model.weights, mode, 32)
    for rank in range(2):
        shard = shard_weights(weights, config, rank, 2)
        i, q = 64, 32
        whole, part = weights.layers[0], shard.layers[0]
        down = whole.down.dequantize_rows()[:, rank * i : (rank + 1) * i]
        torch.testing.assert_close(part.down.dequantize_rows(), down, atol=0, rtol=0)
        o = whole.o.dequantize_rows()[:, rank * q : (rank + 1) * q]
        torch.testing.assert_close(part.o.dequantize_rows(), o, atol=0, rtol=0)
        gate_up = whole.gate_up.dequantize_rows()
        rows = torch.cat([torch.arange(rank * i, (rank + 1) * i)] * 2)
        rows[i:] += 128
        torch.testing.assert_close(part.gate_up.dequantize_rows(), gate_up[rows], atol=0, rtol=0)


def test_int4_shards_off_group_boundaries_are_refused():
    config = PRESETS["tiny"]  # intermediate 160: 80 per rank, not a multiple of groups of 32
    model, _ = load_model(config)
    weights = model.weights
    layer = weights.layers[0]
    layer.down = quantize(layer.down, "int4", 32)
    with pytest.raises(TensorParallelConfigError, match="group boundaries"):
        shard_weights(weights, config, 0, 2)
