"""Weight-only quantization and the fp8 KV cache on the CPU, every mode side by side in one
run: weights bytes in RAM, KV bytes per token, single-stream and 16-stream decode tokens/s
(EOS ignored; rounds interleaved across modes so load from other processes hits all alike,
best round kept), and the mean NLL of a fixed text. Full size (the default model) with
PAGEDKERN_BENCH_SMOKE=0 on a CPU machine; smoke mode runs the tiny synthetic model once.
The quantized GEMM on a GPU (GB/s vs bf16 torch.mm vs copy bandwidth) is in
test_bench_quant_gemm.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_agreement import mean_nll  # noqa: E402

FULL = os.environ.get("PAGEDKERN_BENCH_SMOKE") == "0"
if FULL and torch.cuda.is_available():
    pytest.skip("CPU benchmark; this machine has a GPU", allow_module_level=True)
assert FULL or smoke_mode()
MODEL, TOKENS, ROUNDS = (None, 48, 2) if FULL else ("synthetic:tiny", 4, 1)
MODES = [("none", "auto"), ("int8", "auto"), ("int4", "auto"), ("int4", "fp8"), ("none", "fp8")]
PROMPT = [{"role": "user", "content": "Tell me about the history of Paris."}]


def decode_rate(llm: LLM, streams: int) -> float:
    """Generated tokens/s of `streams` concurrent requests (prefill included, 1 token each)."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat([PROMPT] * streams, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(g.token_ids) == TOKENS for g in out)
    return streams * TOKENS / seconds


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
    for _ in range(ROUNDS):
        for streams in (1, 16):
            for mode, llm in engines.items():
                rates[mode][streams] = max(rates[mode][streams], decode_rate(llm, streams))
    base = rates["none", "auto"][1]
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
                vs_fp32_single=round(rates[q, kv][1] / base, 2),
                weights_mb=round(model.weights.nbytes / 1e6, 1),
                kv_bytes_per_token=kv_per_token,
                nll=round(nll, 4),
            )
