"""Shared pieces of the tensor-parallel tests: the models, the workload, a logits recorder."""

from __future__ import annotations

import torch
from hf_model_files import base_config, write_folder

from pagedkern.engine import LLM, SamplingParams

# A small pool (preemption), small blocks (prefix hits on short shared prefixes) and a small
# token budget (chunked prefill) so one workload exercises every scheduling path.
SETTINGS = dict(
    block_size=4, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=8, seed=3,
    kv_cache_dtype="float32",
)  # fmt: skip
# fp32 everywhere, the cache too: TP changes only the summation order of the all-reduces (and
# the GEMMs' split K), so logits agree to float32 rounding of sums of O(1) terms.
LOGITS_ATOL = 2e-4
# The KV cache holds K/V projections that reach ~10, where the same rounding of sums is the
# same relative size (measured: 2.1e-4 at 10.7 on an AMD EPYC, 1.98e-5 relative).
KV_RTOL = 2e-5


def mqa_folder(path) -> str:
    """6 query heads, 1 KV head (replicated at TP = 3), biases on q/k/v, o and the MLP, and a
    vocabulary of 400 that 3 does not divide (shards 134, 134, 132)."""
    cfg = base_config(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=1,
        intermediate_size=96,
        attention_bias=True,
        mlp_bias=True,
    )
    path.mkdir(parents=True, exist_ok=True)
    write_folder(path, cfg)
    return str(path)


def prompts(vocab: int, count: int = 12) -> list[list[int]]:
    """12 varied prompts: lengths 1..45, four sharing a 13-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, vocab, (13,), generator=g).tolist()
    out = []
    for i in range(count):
        n = [1, 3, 45, 9, 30, 2, 17, 5, 38, 11, 24, 7][i]
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(shared + ids if i % 3 == 0 else ids)
    return out


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def sampled(count: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, ignore_eos=True
        )
        for i in range(count)
    ]


def record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's sampled logits rows on rank 0, in step order."""
    runner = llm.engine.runner
    run, steps = runner.run, []

    def recording(entries, forks=None):
        result = run(entries, forks)
        if result.logits is not None:
            steps.append(result.logits.clone())
        return result

    runner.run = recording
    return steps
