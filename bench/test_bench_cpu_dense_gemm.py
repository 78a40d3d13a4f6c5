"""The CPU backend's fixed-order fp32 GEMM (csrc/cpu/dense_gemm.cpp, `cpu_linear:fixed_order`)
against torch's F.linear (oneDNN / MKL, `cpu_linear:blas`), interleaved (each case times both
before the next), at SmolLM2-135M's shapes (QKV, gate/up, down, a slice of its LM head) and a
~1B model's (2048 hidden, 8192 intermediate), M = 1 .. 512. Prints microseconds, GFLOP/s and
blas / fixed (above 1: the fixed order is faster). test_cpu_dense_gemv_from_dram times one row
as a decode runs it, over copies of the weight that pass the last-level cache, beside the copy
bandwidth of as many bytes (the ceiling a GEMV approaches). Threads: PAGEDKERN_BENCH_THREADS
(default 1). Full sizes with PAGEDKERN_BENCH_CPU=1 (or PAGEDKERN_BENCH_SMOKE=0) on a machine
without a GPU; smoke mode runs tiny shapes once."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from measure import best_host_us, host_copy_bandwidth, smoke_mode

from pagedkern.ops.cpu import dense_linear, quant_gemv

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", 1))
SHAPES = (
    [("135m qkv", 960, 576), ("135m gate_up", 3072, 576), ("135m down", 576, 1536),
     ("135m lm_head/8", 6144, 576), ("1b gate_up", 16384, 2048), ("1b down", 2048, 8192)]
    if FULL else [("tiny", 64, 96)]
)  # fmt: skip
MS = (1, 4, 16, 64, 256, 512) if FULL else (1, 5)
pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")


def _best_us(fn, reps: int) -> float:
    return best_host_us(fn, reps, 3 if FULL else 1)


def test_cpu_dense_gemm(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k)
        for m in MS:
            x = torch.randn(m, k)
            reps = max(2, int(2e8 / (n * k * m))) if FULL else 1
            ours = _best_us(lambda: dense_linear.dense_gemm(x, w), reps)  # noqa: B023
            theirs = _best_us(lambda: F.linear(x, w), reps)  # noqa: B023
            flops = 2 * m * n * k / 1e3
            lines.append(
                f"  {name:16s} M={m:<4d} {ours:10.1f} {theirs:10.1f} {flops / ours:8.1f} "
                f"{flops / theirs:8.1f} {theirs / ours:10.2f}x"
            )
    with capsys.disabled():
        print(f"\nCPU fp32 GEMM, {THREADS} thread(s); microseconds (best of 3), GFLOP/s")
        print(
            f"  {'weight':16s} {'M':6s} {'fixed':>10s} {'blas':>10s} {'GF/s':>8s} {'GF/s':>8s} "
            f"{'blas/fixed':>11s}"
        )
        print("\n".join(lines))


# one row over copies of each weight past DRAM_BYTES: read from DRAM, as a decode reads a model
DRAM_BYTES = (768 << 20) if FULL else (1 << 18)
DRAM_SHAPES = (
    [("1b gate_up", 16384, 2048), ("1b down", 2048, 8192), ("135m gate_up", 3072, 576)]
    if FULL else [("tiny", 64, 256)]
)  # fmt: skip


def _rotating(fn, x: torch.Tensor, copies: list[torch.Tensor]):
    """fn(x, the next copy) at each call: each weight read from DRAM, as a decode reads a model"""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(x, copies[state["i"]])

    return call


def test_cpu_dense_gemv_from_dram(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, n, k in DRAM_SHAPES:
        nbytes = n * k * 4
        copies = [torch.randn(n, k) for _ in range(max(2, DRAM_BYTES // nbytes))]
        x = torch.randn(1, k)
        reps = len(copies)
        ours = _best_us(_rotating(dense_linear.dense_gemm, x, copies), reps)
        theirs = _best_us(_rotating(F.linear, x, copies), reps)
        lines.append(
            f"  {name:16s} {ours:10.1f} {theirs:10.1f} {nbytes / ours / 1e3:8.1f} "
            f"{nbytes / theirs / 1e3:8.1f} {theirs / ours:10.2f}x"
        )
    copy = host_copy_bandwidth((256 << 20) if FULL else 1 << 16)
    with capsys.disabled():
        print(
            f"\nCPU fp32 GEMV from DRAM, {THREADS} thread(s), copy bandwidth {copy:.1f} GB/s; "
            "microseconds (best of 3), weight GB/s"
        )
        print(
            f"  {'weight':16s} {'fixed':>10s} {'blas':>10s} {'GB/s':>8s} {'GB/s':>8s} "
            f"{'blas/fixed':>11s}"
        )
        print("\n".join(lines))


# the engine on an fp32 model of SmolLM2-135M's shape: a prefill, one stream's decode, 16 streams'
ENGINE_MODEL, PREFILL, DECODE = (
    ("synthetic:smollm2-135m", 512, 64) if FULL else ("synthetic:tiny", 16, 4)
)


def _engine_rates(variant: str) -> tuple[float, float, float]:
    """(prefill tok/s, 1-stream decode tok/s, 16-stream decode tok/s) under cpu_linear:variant"""
    from pagedkern.engine import Engine, EngineConfig, SamplingParams
    from pagedkern.ops.variants import use_kernels

    with use_kernels(cpu_linear=variant):
        engine = Engine.from_config(
            EngineConfig(model=ENGINE_MODEL, backend="cpu", max_num_batched_tokens=PREFILL)
        )

        def run(prompts: list[list[int]], tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            for ids in prompts:
                engine.add_request(prompt_ids=ids, params=params)
            t0 = time.perf_counter()
            while engine.has_unfinished:
                engine.step()
            return time.perf_counter() - t0

        # (each prompt its own: a repeated one would be read from the prefix cache)
        prefill = PREFILL / min(
            run([[5 + (i * (r + 3)) % 97 for i in range(PREFILL)]], 1) for r in range(2)
        )
        one = run([[7, 8, 9]], DECODE + 1) - run([[7, 8, 9]], 1)
        many = run([[7 + s, 8, 9] for s in range(16)], DECODE + 1) - run(
            [[7 + s, 8, 9] for s in range(16)], 1
        )
    return prefill, DECODE / one, 16 * DECODE / many


def test_cpu_dense_linear_engine(capsys):
    torch.set_num_threads(THREADS)
    rates = {v: [] for v in ("fixed_order", "blas")}
    for _ in range(2 if FULL else 1):  # interleaved rounds, best of each
        for variant in rates:
            rates[variant].append(_engine_rates(variant))
    best = {v: [max(r[i] for r in runs) for i in range(3)] for v, runs in rates.items()}
    with capsys.disabled():
        print(
            f"\n{ENGINE_MODEL} fp32 on the CPU backend, {THREADS} thread(s); tokens/s (best of 2)"
        )
        print(f"  {'':14s} {'prefill ' + str(PREFILL):>12s} {'decode x1':>10s} {'decode x16':>10s}")
        for variant, (p, one, many) in best.items():
            print(f"  {variant:14s} {p:12.1f} {one:10.1f} {many:10.1f}")
        ratio = [f / b for f, b in zip(best["fixed_order"], best["blas"], strict=True)]
        print(f"  {'fixed / blas':14s} {ratio[0]:11.2f}x {ratio[1]:9.2f}x {ratio[2]:9.2f}x")
