"""Weight-only quantization and the fp8 KV cache on the CPU, every mode side by side in one
run: weights bytes in RAM, KV bytes per token, single-stream and 16-stream decode tokens/s
(EOS ignored; rounds interleaved across modes so load from other processes hits all alike,
best round kept), and the mean NLL of a fixed text. Full size (the default model) with
PAGEDKERN_BENCH_SMOKE=0 on a CPU machine; smoke mode runs the tiny synthetic model once.
The quantized GEMM on a GPU (GB/s vs bf16 torch.mm vs copy bandwidth) is in
test_bench_quant_gemm.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_agreement import mean_nll  # noqa: E402

FULL = not smoke_mode()  # PAGEDKERN_BENCH_SMOKE=0, or a GPU machine (skipped below)
# The smoke run builds engines and models several times over: `slow` (CI runs it).
pytestmark = pytest.mark.slow
if FULL and torch.cuda.is_available():
    # Never an assert at import: on a GPU machine collection must go on (the GPU-check
    # rehearsal, tests/test_gpu_check_rehearsal.py, fails on an aborted collection).
    pytest.skip(
        "CPU benchmark of the quantized modes; this machine has a GPU", allow_module_level=True
    )
MODEL, TOKENS, ROUNDS = (None, 48, 2) if FULL else ("synthetic:tiny", 4, 1)
# (weights, KV cache): the weights modes over a float32 cache, then the default (int4 over a
# float16 cache) and the fp8 caches
MODES = [
    ("none", "float32"), ("int8", "float32"), ("int4", "float32"), ("int4", "auto"),
    ("int4", "fp8"), ("none", "fp8"),
]  # fmt: skip
PROMPT = [{"role": "user", "content": "Tell me about the history of Paris."}]


def decode_rate(llm: LLM, streams: int) -> tuple[float, float]:
    """Generated tokens/s of `streams` concurrent requests: end to end (prefill included) and
    decode only (first token to last: the TOKENS - 1 tokens after the prefill's)."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat([PROMPT] * streams, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(g.token_ids) == TOKENS for g in out)
    first = min(g.metrics.first_token_time for g in out)
    last = max(g.metrics.last_token_time for g in out)
    return streams * TOKENS / seconds, streams * (TOKENS - 1) / (last - first)


@pytest.fixture(scope="module")
def engines() -> dict:
    llms = {}
    for q, kv in MODES:
        llms[q, kv] = LLM(
            MODEL, quantization=q, kv_cache_dtype=kv, backend="reference", device="cpu",
            max_num_seqs=16, kv_cache_gib=0.25, enable_prefix_caching=False,
        )  # fmt: skip
        decode_rate(llms[q, kv], 1)  # warm-up: packing, first-call costs
    return llms


def test_quantization_modes_side_by_side(engines, record):
    rates: dict = {mode: {1: 0.0, 16: 0.0} for mode in MODES}
    decode: dict = {mode: {1: 0.0, 16: 0.0} for mode in MODES}  # prefill excluded
    for _ in range(ROUNDS):
        for streams in (1, 16):
            for mode, llm in engines.items():
                total, decoding = decode_rate(llm, streams)
                rates[mode][streams] = max(rates[mode][streams], total)
                decode[mode][streams] = max(decode[mode][streams], decoding)
    base = rates["none", "float32"][1]
    for (q, kv), llm in engines.items():
        model, cache = llm.engine.model, llm.engine.kv_cache
        kv_per_token = cache.data[:, :, :1, :, :1].numel() * cache.data.element_size()
        nll = mean_nll(llm)
        assert torch.isfinite(torch.tensor(nll))
        for streams in (1, 16):
            record(
                "quantization (CPU, default model)" if FULL else "quantization (smoke)",
                f"{streams} stream{'s' if streams > 1 else ''} x {TOKENS} tokens",
                f"weights {q}, kv {kv}",
                streams * TOKENS / rates[q, kv][streams],
                tokens_per_s=round(rates[q, kv][streams], 1),
                decode_tokens_per_s=round(decode[q, kv][streams], 1),
                vs_fp32_single=round(rates[q, kv][1] / base, 2),
                weights_mb=round(model.weights.nbytes / 1e6, 1),
                kv_bytes_per_token=kv_per_token,
                nll=round(nll, 4),
            )


@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
@pytest.mark.parametrize("streams", [1, 16])
def test_cpu_decode_step_fast_vs_plain(record, quantization, streams):
    """One decode step (hidden states + LM head) on the CPU backend vs the reference backend,
    rounds interleaved, best kept; wall clock and process CPU time (the latter is what to
    compare on a machine shared with other work)."""
    from pagedkern import ops
    from pagedkern.model import SequenceChunk, build_batch, load_model

    model, _ = load_model(MODEL, quantization=quantization)
    context, block = (90, 16) if FULL else (20, 16)
    per_seq = context // block + 2
    kv = model.allocate_kv_cache(streams * per_seq + 1, block)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(streams)]
    ids, meta = build_batch([SequenceChunk([5], context, t) for t in tables], block)
    best = {fast: [float("inf"), float("inf")] for fast in (False, True)}
    for _ in range(3 if FULL else 1):
        for fast in (False, True):
            with ops.use_backend("cpu" if fast else "reference"):
                model.compute_logits(model.hidden_states(ids, meta, kv))  # warm-up
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(5):
                    model.compute_logits(model.hidden_states(ids, meta, kv))
            best[fast][0] = min(best[fast][0], (time.perf_counter() - wall) / 5)
            best[fast][1] = min(best[fast][1], (time.process_time() - cpu) / 5)
    for fast in (False, True):
        record(
            "CPU decode step" + ("" if FULL else " (smoke)"),
            f"{quantization}, {streams} x {context} tokens of context",
            "cpu backend" if fast else "reference backend",
            best[fast][0],
            cpu_ms=round(best[fast][1] * 1e3, 2),
            speedup_cpu=round(best[False][1] / best[fast][1], 2),
        )
