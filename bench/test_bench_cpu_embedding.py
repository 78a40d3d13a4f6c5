"""The CPU backend's embedding lookup from a quantized table (csrc/cpu/dequantize_rows.cpp,
ops/cpu/embedding.py) against the reference's QuantizedWeight.dequantize_rows (the same bits),
interleaved, for SmolLM2-135M's tied Q8_0 table (int8, groups of 32, 49152 x 576) and an int4
table of a ~1B Llama's width (groups of 32, 32000 x 2048), at 1, 16 and 512 ids (a decode
step, 16 streams, a prompt chunk). Prints microseconds a call, the bytes read and written per
second beside the copy bandwidth measured in the same run (the ceiling), and reference / C++.
Full sizes with PAGEDKERN_BENCH_CPU=1 (or PAGEDKERN_BENCH_SMOKE=0) on a machine without a GPU;
smoke mode runs a tiny table once."""

from __future__ import annotations

import os

import pytest
import torch
from measure import best_host_us, host_copy_bandwidth, smoke_mode

from pagedkern.model.quantized_linear import quantize_int4, quantize_int8_grouped
from pagedkern.ops.cpu import embedding, quant_gemv

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
# (name, rows, width, quantize, bytes a weight)
TABLES = [
    ("135m int8 g32", 49152, 576, lambda w: quantize_int8_grouped(w, 32), 1 + 4 / 32),
    ("1b int4 g32", 32000, 2048, lambda w: quantize_int4(w, 32), 0.5 + 4 / 32),
]
IDS = (1, 16, 512) if FULL else (1, 3)


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_embedding_rows(capsys):
    tables = TABLES if FULL else [("tiny int4 g32", 64, 64, lambda w: quantize_int4(w, 32), 0.625)]
    copy = host_copy_bandwidth((64 << 20) if FULL else 1 << 16)
    lines = []
    for name, n, k, quantize, weight_bytes in tables:
        weight = quantize(torch.randn(n, k) * 0.05)
        for m in IDS:
            ids = torch.randint(0, n, (m,), dtype=torch.int32)
            cpp = lambda: embedding.dequantize_rows(weight, ids, torch.float32)  # noqa: E731, B023
            ref = lambda: weight.dequantize_rows(ids, torch.float32)  # noqa: E731, B023
            assert torch.equal(cpp(), ref())
            calls = max(1, 2000 // m) if FULL else 1
            us = {f: best_host_us(f, calls, 3 if FULL else 1) for f in (cpp, ref)}
            moved = m * k * (weight_bytes + 4)  # the rows' weights read, fp32 rows written
            lines.append(
                f"  {name:14s} {m:5d} {us[cpp]:9.2f} {us[ref]:9.2f} {moved / us[cpp] / 1e3:7.2f} "
                f"{us[ref] / us[cpp]:8.2f}x"
            )
    with capsys.disabled():
        print(f"\nCPU embedding rows, microseconds a call (best of 3); copy {copy:.1f} GB/s")
        print(
            f"  {'table':14s} {'ids':>5s} {'C++':>9s} {'reference':>9s} {'GB/s':>7s} "
            f"{'ref/C++':>9s}"
        )
        print("\n".join(lines))
