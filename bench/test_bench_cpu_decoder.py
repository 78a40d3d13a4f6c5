"""The CPU backend's one-call decoder (csrc/cpu/decoder.cpp) against the layer loop it replaces
(`cpu_decoder:layers`: the same C++ pieces, one Python call each) and against the loop with every
op its own call (`cpu_layer_tail:ops` too: how Gemma's layers ran before the fused tail took
GeGLU and sandwich norms), per model family's layer
shape: SmolLM2-135M (Llama), Qwen3-0.6B (QK-norm), Gemma-3-1B (QK-norm, GeGLU, sandwich
norms, 5 local layers per global one, a local RoPE base) and four Qwen3-30B-A3B MoE layers,
int4 (G = 32) random weights, and SmolLM2 over an fp8 (E4M3) KV cache. A decode
step of B sequences of CONTEXT tokens each (every layer, no LM head: the vocabulary is shrunk),
milliseconds, median of interleaved rounds in one run, and the ratios to fused. One thread
by default (PAGEDKERN_BENCH_THREADS). Full sizes with PAGEDKERN_BENCH_CPU=1 (or
PAGEDKERN_BENCH_SMOKE=0) on a machine without a GPU; smoke mode runs a tiny shape once."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from measure import smoke_mode

from pagedkern import ops
from pagedkern.model import PRESETS, SequenceChunk, build_batch, load_model
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.variants import use_kernels

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", 1))
BLOCK = 16
CONTEXT = 256 if FULL else 20
BATCHES = (1, 16) if FULL else (1, 3)
ROUNDS = 5 if FULL else 1
QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, rope_theta=1e6, qk_norm=True,
)  # fmt: skip
SHAPES = {  # name -> the preset, its changes (vocabularies shrunk: no LM head is timed), KV dtype
    "smollm2-135m": ("smollm2-135m", {}, "auto"),
    "smollm2 fp8kv": ("smollm2-135m", {}, "fp8"),
    "qwen3-0.6b": ("smollm2-135m", QWEN3_06B, "auto"),
    "gemma3-1b": ("gemma3-1b", {}, "auto"),
    # Qwen3-30B-A3B's layer with 32 of its 128 experts (a token's work is the same: top 8)
    "qwen3-moe": ("qwen3-30b-a3b", dict(num_layers=4, num_experts=32), "auto"),
}
VARIANTS = {  # column -> the variants it selects
    "fused": dict(cpu_decoder="fused"),
    "layers": dict(cpu_decoder="layers"),
    "ops": dict(cpu_decoder="layers", cpu_layer_tail="ops"),
}
if not FULL:
    SHAPES = {
        "tiny qwen3": ("tiny", dict(qk_norm=True), "fp8"),
        "tiny moe": (
            "tiny",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
            "auto",
        ),
    }


def _step_ms(model, kv, batch, steps: int) -> float:
    """Milliseconds a decode step of `batch` rows takes (the best of `steps`)."""
    chunks = [
        SequenceChunk([7], CONTEXT, list(range(b * 20 + 1, b * 20 + 1 + CONTEXT // BLOCK + 1)))
        for b in range(batch)
    ]
    ids, meta = build_batch(chunks, BLOCK)
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        model.hidden_states(ids, meta, kv)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_decoder_against_the_layer_loop(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, (preset, changes, kv_dtype) in SHAPES.items():
        config = PRESETS[preset].replace(vocab_size=512, **changes)
        model, _ = load_model(config, quantization="int4", kv_cache_dtype=kv_dtype, seed=0)
        kv = model.allocate_kv_cache(max(BATCHES) * 20 + 8, BLOCK)
        with ops.use_backend("cpu"):
            prefill = [
                SequenceChunk(list(range(1, CONTEXT + 1)), 0, list(range(1 + b * 20, 21 + b * 20)))
                for b in range(max(BATCHES))
            ]
            model.hidden_states(*build_batch(prefill, BLOCK), kv)
            for batch in BATCHES:
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for _ in range(ROUNDS):
                    for variant, got in times.items():
                        with use_kernels(**VARIANTS[variant]):
                            got.append(_step_ms(model, kv, batch, 3 if FULL else 1))
                fused, layers, by_ops = (statistics.median(t) for t in times.values())
                lines.append(
                    f"  {name:13s} B={batch:<3d} {fused:9.2f} {layers:9.2f} {by_ops:9.2f} "
                    f"{layers / fused:12.2f}x {by_ops / fused:9.2f}x"
                )
    with capsys.disabled():
        print(
            f"\nCPU decoder (int4 G=32), decode step at context {CONTEXT}, {THREADS} thread(s); "
            f"ms, median of {ROUNDS} interleaved rounds (best of 3 steps each)"
        )
        print(
            f"  {'shape':13s} {'batch':5s} {'fused':>9s} {'layers':>9s} {'ops':>9s} "
            f"{'layers/fused':>13s} {'ops/fused':>10s}"
        )
        print("\n".join(lines))
