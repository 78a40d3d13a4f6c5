"""The serving benchmark: bench/load_generator.py against pagedkern's HTTP server on a loopback
port (streamed chat requests arriving as a Poisson process). Smoke mode: the tiny synthetic
model, 16 requests, checked for completeness (every request answered, exactly --output-len
tokens each, latencies reported). Full size (PAGEDKERN_BENCH_SMOKE=0 on a CPU machine): the
default model, 32 requests at 4 req/s; skipped on GPU machines like the engine's CPU benchmark.
Numbers land in the benchmark table (and $PAGEDKERN_BENCH_JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from measure import smoke_mode

FULL = not smoke_mode()  # PAGEDKERN_BENCH_SMOKE=0, or a GPU machine (skipped below)
if FULL and torch.cuda.is_available():
    pytest.skip(
        "CPU serving benchmark of the reference ops; this machine has a GPU",
        allow_module_level=True,
    )
for _name in ("fastapi", "uvicorn", "pydantic"):  # the server's stack: optional on GPU machines
    pytest.importorskip(_name)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test harnesses
from load_generator import main as load_generator  # noqa: E402
from support.serving import ServerThread  # noqa: E402

from pagedkern.engine import Engine, EngineConfig  # noqa: E402

MODEL, PROMPTS, RATE, INPUT, OUTPUT = (
    (None, 32, 4.0, 48, 32) if FULL else ("synthetic:tiny", 16, 50.0, 24, 8)
)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_load_generator_against_the_server(endpoint, record, tmp_path, capsys):
    engine = Engine.from_config(
        EngineConfig(
            model=MODEL,
            backend="reference",
            device="cpu",
            max_num_seqs=PROMPTS,
            num_blocks=None if FULL else 2048,  # the tiny model needs no 1 GiB cache
        )
    )
    out = tmp_path / "result.json"
    with ServerThread(engine) as server:
        result = load_generator(
            [
                f"--base-url={server.url}",
                f"--endpoint={endpoint}",
                f"--num-prompts={PROMPTS}",
                f"--request-rate={RATE}",
                f"--input-len={INPUT}",
                f"--output-len={OUTPUT}",
                "--ignore-eos",
                "--percentiles=50,99",
                f"--result-json={out}",
            ]
        )
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert json.loads(out.read_text()) == result
    assert result["completed"] == PROMPTS and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == PROMPTS * OUTPUT
    assert result["total_input_tokens"] > PROMPTS * INPUT // 2
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    record(
        "serving (HTTP + SSE, CPU reference ops)",
        f"{PROMPTS} req x {OUTPUT} tokens @ {RATE:g} req/s, {endpoint}",
        MODEL or "SmolLM2-135M",
        result["duration_s"],
        req_per_s=round(result["request_throughput"], 2),
        output_tok_per_s=round(result["output_throughput"], 1),
        ttft_ms=round(result["median_ttft_ms"], 1),
        tpot_ms=round(result["median_tpot_ms"], 1),
        itl_p99_ms=round(result["p99_itl_ms"], 1),
    )
