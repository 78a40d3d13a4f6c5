"""CPU sampling, side by side and interleaved (ratios measured in one run hold on a noisy host):
the CPU backend's C++ rows (csrc/cpu/sampling.cpp, the default), the reference (torch ops,
which sort the whole vocabulary for top-k and top-p), and the usual PyTorch top-p recipe
(softmax, sort, cumsum, mask, multinomial).

SmolLM2's vocabulary (49152) and Qwen3's (151936), batch 1 and 16, logits N(0, 4^2) at
temperature 0.8: greedy, plain sampling, top-p 0.9, top-k 50 + top-p 0.95, and top-p 0.9 with the
sampled token's logprob and the top 5 (OpenAI's logprobs / top_logprobs). GB/s is one read of
the logits (the rows make a few passes, mostly from cache), against one large copy's rate (the
host's ceiling). Full sizes with PAGEDKERN_BENCH_SMOKE=0 (or PAGEDKERN_BENCH_CPU=1); smoke
mode runs a small vocabulary once."""

from __future__ import annotations

import os
import time

import pytest
import torch
from measure import smoke_mode
from test_bench_sampling import sort_top_p  # (the GPU suite's baseline, the same recipe)

from pagedkern import reference
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.cpu import sampling as cpu_sampling

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
VOCABS = (49152, 151936) if FULL else (1000,)
ROUNDS = 5 if FULL else 1
TEMPERATURE = 0.8
CASES = {  # (temperature, top_p, top_k, top logprobs)
    "greedy": (0.0, 1.0, 0, 0),
    "plain": (TEMPERATURE, 1.0, 0, 0),
    "top-p 0.9": (TEMPERATURE, 0.9, 0, 0),
    "top-k 50 + top-p 0.95": (TEMPERATURE, 0.95, 50, 0),
    "top-p 0.9 + 5 logprobs": (TEMPERATURE, 0.9, 0, 5),
}


def _copy_gbps() -> float:
    x = torch.empty(64 << 20, dtype=torch.uint8)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() / best / 1e9


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("vocab", VOCABS)
def test_cpu_sampling(vocab, rows, capsys):
    g = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=g) * 4
    seeds = torch.arange(rows, dtype=torch.int64) * 7919
    offsets = torch.zeros(rows, dtype=torch.int64)
    lines = []
    for case, (temperature, top_p, top_k, top_n) in CASES.items():
        params = (
            torch.full((rows,), temperature),
            torch.full((rows,), top_p),
            torch.full((rows,), top_k, dtype=torch.int32),
            seeds,
            offsets,
        )
        outputs = {}
        if top_n:  # the sampled token's logprob and the top-N, as the engine asks for them
            outputs = {
                "logprobs": torch.empty(rows),
                "top_ids": torch.empty(rows, top_n, dtype=torch.int32),
                "top_logprobs_out": torch.empty(rows, top_n),
            }
        candidates = {
            "cpu backend": lambda p=params, o=outputs: cpu_sampling.sample(logits, *p, **o),
            "reference": lambda p=params, o=outputs: reference.sample(logits, *p, **o),
        }
        if temperature > 0 and not top_n:
            candidates["torch sort top-p"] = lambda c=CASES[case]: sort_top_p(logits, *c[:3])
        want = reference.sample(logits, *params)
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(ROUNDS):
            for name, fn in candidates.items():
                start = time.perf_counter()
                got = fn()
                times[name].append(time.perf_counter() - start)
                if name == "cpu backend":  # the same ids but where rounding moves a boundary
                    assert (got != want).sum() <= max(1, rows // 8)
        best = {name: min(t) for name, t in times.items()}
        cells = "  ".join(
            f"{name} {t * 1e3:8.3f} ms ({best['reference'] / t:6.1f}x ref, "
            f"{rows * vocab * 4 / t / 1e9:5.1f} GB/s)"
            for name, t in best.items()
        )
        lines.append(f"  {case:22s} {cells}")
    with capsys.disabled():
        print(
            f"\nsampling, B={rows} V={vocab}, {torch.get_num_threads()} threads (best of "
            f"{ROUNDS}); copy ceiling {_copy_gbps():.1f} GB/s"
        )
        print("\n".join(lines))
