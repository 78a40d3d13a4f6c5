"""The CPU backend's fused layer tail (csrc/cpu/layer_tail.cpp: O GEMV, add+norm, gate/up GEMV,
SiLU x mul, down GEMV, add+norm in one call) against the same tail as the CPU backend's ops one
by one (the step table the model calls: the same C++ GEMV) and as the reference backend's ops,
interleaved, at SmolLM2-135M's layer shape and a ~1B Llama's (int4 G = 32), M = 1 .. 64, one
thread by default (PAGEDKERN_BENCH_THREADS). Prints microseconds, the weight bytes read per
second at M = 1 beside the copy bandwidth measured in the same run (a GEMV's ceiling), and ops /
fused: at M = 1 the ops' dispatch is what the fused call removes. Full sizes with
PAGEDKERN_BENCH_CPU=1 (or PAGEDKERN_BENCH_SMOKE=0) on a machine without a GPU; smoke mode runs a
tiny shape once."""

from __future__ import annotations

import os

import pytest
import torch
from measure import best_host_us, host_copy_bandwidth, smoke_mode

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_int4
from pagedkern.model.weights import LayerWeights
from pagedkern.ops import cpu
from pagedkern.ops.cpu import layer_tail, quant_gemv

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", 1))
# (name, hidden, intermediate, q_size)
SHAPES = [("135m", 576, 1536, 576), ("1b", 2048, 8192, 2048)] if FULL else [("tiny", 64, 96, 64)]
MS = (1, 4, 16, 64) if FULL else (1, 3)
EPS = 1e-5


def _best_us(fn, reps: int) -> float:
    return best_host_us(fn, reps, 3 if FULL else 1)


def _copy_gbs() -> float:
    return host_copy_bandwidth((64 << 20) if FULL else 1 << 16)


def _layer(hidden: int, inter: int, q_size: int) -> LayerWeights:
    def w(n, k):
        return quantize_int4(torch.randn(n, k) / k**0.5, 32)

    return LayerWeights(
        input_norm=torch.ones(hidden), qkv=None, o=w(hidden, q_size),
        post_norm=torch.rand(hidden) + 0.5, gate_up=w(2 * inter, hidden), down=w(hidden, inter),
    )  # fmt: skip


def _ops_tail(table, attn, residual, layer, next_norm):
    """The model's layer_tail through an op table (LlamaModel.layer_tail without the fusion)."""
    h = table.quant_linear(attn, layer.o)
    h, residual = table.fused_add_rms_norm(h, residual, layer.post_norm, EPS)
    h = table.quant_linear(table.silu_and_mul(table.quant_linear(h, layer.gate_up)), layer.down)
    return table.fused_add_rms_norm(h, residual, next_norm, EPS)


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_layer_tail(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, hidden, inter, q_size in SHAPES:
        layer = _layer(hidden, inter, q_size)
        fused = layer_tail.LayerTail(hidden, inter, q_size, "silu", EPS).for_step()
        table = cpu.step_implementations()
        next_norm = torch.rand(hidden) + 0.5
        nbytes = (hidden * q_size + 3 * hidden * inter) // 2
        for m in MS:
            attn = torch.randn(m, q_size)
            residual = torch.randn(m, hidden)
            reps = max(2, int(1e8 / (nbytes * 2 * m))) if FULL else 1
            attn3 = attn.view(m, 1, q_size)  # (the tail takes the attention's [T, Hq, D])
            ours = _best_us(lambda: fused(attn3, residual, layer, next_norm), reps)  # noqa: B023
            by_ops = _best_us(lambda: _ops_tail(table, attn, residual, layer, next_norm), reps)  # noqa: B023
            with ops.use_backend("reference"):
                ref = _best_us(lambda: _ops_tail(ops, attn, residual, layer, next_norm), 1)  # noqa: B023
            residual.copy_(torch.randn(m, hidden))  # (the runs above added into it)
            gbs = f"{nbytes / ours / 1e3:7.1f}" if m == 1 else " " * 7
            lines.append(
                f"  {name:5s} M={m:<3d} {ours:10.1f} {by_ops:10.1f} {ref:10.1f} {gbs} "
                f"{by_ops / ours:8.2f}x {ref / ours:8.2f}x"
            )
    with capsys.disabled():
        print(
            f"\nCPU layer tail (int4 G=32), {THREADS} thread(s), copy bandwidth "
            f"{_copy_gbs():.1f} GB/s; microseconds (best of 3)"
        )
        print(
            f"  {'shape':11s} {'fused':>10s} {'cpu ops':>10s} {'reference':>10s} {'GB/s':>7s} "
            f"{'ops/fused':>9s} {'ref/fused':>9s}"
        )
        print("\n".join(lines))


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_gated_activation(capsys):
    """The tail's gated activation alone (csrc/cpu/gated_activation.cpp), one thread: the plain
    loop against its AVX2 twin (the same bits), per row of the shapes' widths."""
    module = quant_gemv.cpu_module()
    if not module.path_supported(module.PATHS["avx2"]):
        pytest.skip("this CPU has no AVX2")
    rows, lines = (64 if FULL else 2), []
    for name, _, inter, _ in SHAPES:
        g = torch.randn(rows, 2 * inter) * 4
        out = torch.empty(rows, inter)
        for act, code in (("silu", 0), ("gelu_tanh", 1)):
            per_row = {}
            for simd in (False, True):
                call = lambda: module.gated_activation(  # noqa: E731
                    activation=code, g=g.data_ptr(), out=out.data_ptr(), rows=rows,  # noqa: B023
                    intermediate=inter, simd=simd,  # noqa: B023
                )  # fmt: skip
                per_row[simd] = _best_us(call, 50 if FULL else 1) / rows
            gbs = 3 * inter * 4 / per_row[True] / 1e3  # g's two halves read, out written
            lines.append(
                f"  {name:5s} I={inter:<5d} {act:10s} {per_row[False]:8.2f} {per_row[True]:8.2f} "
                f"{gbs:7.1f} {per_row[False] / per_row[True]:8.2f}x"
            )
    with capsys.disabled():
        print("\nCPU gated activation, one row, microseconds (best of 3; rows of L1/L2)")
        print(
            f"  {'shape':16s} {'act':10s} {'plain':>8s} {'avx2':>8s} {'GB/s':>7s} {'speed-up':>9s}"
        )
        print("\n".join(lines))
