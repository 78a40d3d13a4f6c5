"""The CPU backend's quantized experts in one C++ call (csrc/cpu/moe_experts.cpp) against the
host loop it replaces (`cpu_moe:loop`: per expert ~10 torch ops and two GEMV calls), one MoE
layer of Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top 8, expert MLP 768; int4 G = 32,
random weights, softmax routing), T = 1 (a decode token), 4 and 16 tokens: microseconds, median
of interleaved rounds in one run, and loop / fused. The weight bytes the routed experts read at
T = 1 per second beside the copy bandwidth measured in the same run. One thread by default
(PAGEDKERN_BENCH_THREADS). Full sizes with PAGEDKERN_BENCH_CPU=1 (or PAGEDKERN_BENCH_SMOKE=0)
on a machine without a GPU; smoke mode runs a tiny shape once."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from measure import host_copy_bandwidth, smoke_mode

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_experts
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.variants import use_kernels
from pagedkern.reference.quantized_weight import QuantizedWeight

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", 1))
HIDDEN, EXPERTS, TOP_K, INTER = (2048, 128, 8, 768) if FULL else (64, 8, 2, 32)
TOKENS = (1, 4, 16) if FULL else (1, 3)
ROUNDS = 5 if FULL else 1


def _experts(n: int, k: int, g: torch.Generator) -> QuantizedWeight:
    """[E, n, k] int4 experts, quantized 16 at a time (the fp32 stack would be GBs)."""
    step = min(16, EXPERTS)
    parts = [
        quantize_experts(torch.randn(step, n, k, generator=g) * k**-0.5, "int4", 32)
        for _ in range(EXPERTS // step)
    ]
    cat = [torch.cat([getattr(p, f) for p in parts]) for f in ("qweight", "scales", "mins")]
    return QuantizedWeight("int4", (EXPERTS, n, k), *cat, 32)


def _best_us(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_moe_against_the_loop(capsys):
    torch.set_num_threads(THREADS)
    g = torch.Generator().manual_seed(0)
    gate_up, down = _experts(2 * INTER, HIDDEN, g), _experts(HIDDEN, INTER, g)
    expert_bytes = 3 * HIDDEN * INTER * (0.5 + 4 / 32)  # int4 codes + fp16 scale and min
    lines = []
    with ops.use_backend("cpu"):
        for tokens in TOKENS:
            x = torch.randn(tokens, HIDDEN, generator=g)
            logits = torch.randn(tokens, EXPERTS, generator=g)
            times: dict[str, list[float]] = {"fused": [], "loop": []}
            for _ in range(ROUNDS):
                for variant, got in times.items():
                    with use_kernels(cpu_moe=variant):
                        call = lambda: ops.fused_moe(x, logits, gate_up, down, TOP_K)  # noqa: E731,B023
                        call()  # (first-call packing out)
                        got.append(_best_us(call, 5 if FULL else 1))
            fused, loop = (statistics.median(t) for t in times.values())
            gbs = f"{TOP_K * expert_bytes / fused / 1e3:7.1f}" if tokens == 1 else " " * 7
            lines.append(f"  T={tokens:<4d} {fused:10.1f} {loop:10.1f} {gbs} {loop / fused:9.2f}x")
    with capsys.disabled():
        copy = host_copy_bandwidth((64 << 20) if FULL else 1 << 16)
        print(
            f"\nCPU MoE layer (H {HIDDEN}, {EXPERTS} experts, top {TOP_K}, I {INTER}, int4 G=32), "
            f"{THREADS} thread(s), copy bandwidth {copy:.1f} GB/s; µs, median of {ROUNDS} rounds"
        )
        print(f"  {'tokens':6s} {'fused':>10s} {'loop':>10s} {'GB/s':>7s} {'loop/fused':>10s}")
        print("\n".join(lines))
