"""The CPU backend's quantized GEMM (csrc/cpu/: 16-bit and 8-bit activations, VNNI/AVX2
integer dots) against torch's int-pack CPU kernels (aten._weight_int4pack_mm_for_cpu,
aten._weight_int8pack_mm: bf16 activations), at the default model's shapes (SmolLM2-135M: QKV,
gate/up, down int4 G = 32, the int8 LM head; gate/up as GGUF Q4_0 too, m = -8d: the int4_sym
tiles, as Q4_K: fp32 scales and mins of two levels, the int4_k tiles, and as Q5_K: codes
0..31 with a scale and min per 32, the int5_g32 tiles, and as AWQ / asymmetric GPTQ at G = 128:
fp16 scales with integer zero points, the int4_zp tiles, beside the same values on int5_g32;
the head also
as GGUF Q8_0 and Q6_K load it: int8 per 32 and int6 per 16, the Q6_K head at K = 1024, a
multiple of Q6_K's 256, as Qwen3-0.6B's) over
M = 1 .. 512, interleaved (each case times all three before the next), one thread
by default (PAGEDKERN_BENCH_THREADS). Prints microseconds, the tile bytes read per second at
M = 1 (16-bit activations) beside the copy bandwidth measured in the same run (the ceiling a
GEMV approaches), and torch / gemv16: where the ratio falls below 1 is the crossover; on a CPU
whose default path is AMX, vnni16 / gemv16 (the AMX tiles against the VNNI kernels). Those
weights stay in the cache between calls; test_cpu_gemv_from_dram times a decode's GEMV as a
model runs it, one row over copies of the weight that pass the last-level cache (a ~1B Q4_0
model's gate/up and down, Q6_K and Q8_0 heads), beside the copy bandwidth of as many bytes. Full
sizes with PAGEDKERN_BENCH_CPU=1 (or PAGEDKERN_BENCH_SMOKE=0) on a machine without a GPU; smoke
mode runs tiny shapes once."""

from __future__ import annotations

import os

import pytest
import torch
from measure import best_host_us, host_copy_bandwidth, smoke_mode

from pagedkern.model.quantized_linear import quantize_int4, quantize_int8
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.cpu.int_pack import torch_int_pack_mm
from pagedkern.reference.quantized_weight import QuantizedWeight

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", 1))
SHAPES = (
    [("qkv", "int4", 960, 576), ("gate_up", "int4", 3072, 576), ("gate_up", "q4_0", 3072, 576),
     ("gate_up", "q4_k", 3072, 768), ("gate_up", "q5_k", 3072, 576), ("down", "int4", 576, 1536),
     ("gate_up", "awq", 3072, 768), ("gate_up", "awq_int5", 3072, 768),
     ("lm_head", "int8", 49152, 576), ("lm_head", "q8_0", 49152, 576),
     ("lm_head", "q6_k", 49152, 1024)]
    if FULL else [("tiny", fmt, 64, 256 if fmt in ("q6_k", "q4_k", "awq") else 64)
                  for fmt in ("int4", "q4_0", "q4_k", "q5_k", "int8", "q8_0", "q6_k", "awq")]
)  # fmt: skip
MS = (1, 2, 4, 8, 16, 64, 256, 512) if FULL else (1, 3, 16)
MAX_LM_HEAD_M = 64  # the LM head runs on the sampled rows only
# where the default path is AMX, gemv16 is also timed on the avx512_vnni kernels (M >= 16: the
# AMX tiles take int8_g32 from 16 rows, the int4 formats from 32)
AMX = quant_gemv.available() and quant_gemv.best_path() == "avx512_amx"


def _q4_0(w: torch.Tensor) -> QuantizedWeight:
    """w as GGUF Q4_0 (llama.cpp's rounding: d = the block's signed max / -8, q = x / d + 8 in
    0..15), held as int4 with m = -8d."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    signed_max = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = (signed_max / -8).half()
    inv = torch.where(d == 0, 0.0, 1 / d.float())
    q = (blocks * inv + 8.5).floor().clamp(0, 15).to(torch.uint8).view(n, k)
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    scales = d.view(n, k // 32)
    return QuantizedWeight("int4", (n, k), qweight, scales, (-8 * scales.float()).half(), 32)


def _q8_0(w: torch.Tensor) -> QuantizedWeight:
    """w as int8 with an fp32 scale per 32 along K: GGUF Q8_0's form (the int8_g32 tiles)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    scales = (blocks.abs().amax(-1) / 127).clamp_min(1e-12)
    q = torch.round(blocks / scales[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight("int8", (n, k), q, scales, None, 32)


def _q6_k(w: torch.Tensor) -> QuantizedWeight:
    """w in Q6_K's form (llama.cpp's rounding, simplified): per 16, codes -32..31 under a scale
    d * sc, sc int8 per 16 and d fp16 per 256 with the largest sc -128 (the int6_k tiles)."""
    n, k = w.shape
    blocks = w.view(n, k // 16, 16)
    group = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))[..., 0] / -32
    supers = group.view(n, k // 256, 16)
    top = supers.gather(-1, supers.abs().argmax(-1, keepdim=True))
    d = (top / -128).half().float()
    inv = torch.where(d == 0, 0.0, 1 / d)
    sc = (supers * inv).round().clamp(-128, 127)
    scales = (sc * d).view(n, k // 16)
    inv_s = torch.where(scales == 0, 0.0, 1 / scales)
    q = (blocks * inv_s[..., None]).round().clamp(-32, 31).to(torch.int8).view(n, k)
    return QuantizedWeight("int8", (n, k), q, scales, None, 16)


def _q4_k(w: torch.Tensor) -> QuantizedWeight:
    """w in Q4_K's form (llama.cpp's rounding, simplified): per 32, codes 0..15 under a scale
    d * sc and a min -dmin * mn (the group's min, at most 0), sc and mn 6 bits, d and dmin fp16
    per 256 with the largest sc and mn 63 (the int4_k tiles)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    lo = blocks.amin(-1).clamp_max(0)
    group = ((blocks.amax(-1) - lo) / 15).clamp_min(1e-12)

    def two_level(values: torch.Tensor) -> torch.Tensor:  # [n, k / 32], >= 0
        supers = values.view(n, k // 256, 8)
        d = (supers.amax(-1, keepdim=True) / 63).half().float()
        c = (supers / torch.where(d == 0, 1.0, d)).round().clamp(0, 63)
        return (c * d).view(n, k // 32)

    scales, mins = two_level(group), -two_level(-lo)
    inv = torch.where(scales == 0, 0.0, 1 / scales)
    q = ((blocks - mins[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    q = q.view(n, k)
    return QuantizedWeight("int4", (n, k), (q[:, 0::2] | (q[:, 1::2] << 4)), scales, mins, 32)


def _q5_k(w: torch.Tensor) -> QuantizedWeight:
    """w in Q5_K's form: per 32, codes 0..31 with an fp32 scale (max - min) / 31 and the min
    (llama.cpp forms both from 6-bit sub-scales; the tiles and the speed are the same)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scales = ((hi - lo) / 31).clamp_min(1e-12)
    q = ((blocks - lo[..., None]) / scales[..., None]).round().clamp(0, 31).to(torch.int8)
    return QuantizedWeight("int8", (n, k), q.view(n, k), scales, lo, 32)


def _awq(w: torch.Tensor) -> QuantizedWeight:
    """AWQ / asymmetric GPTQ as the HF loader maps it: codes 0..15 per group of 128, an fp16
    scale s and an integer zero point z, the min -(s z) in fp32 (fp16 cannot hold most): the
    int4_zp tiles."""
    n, k = w.shape
    g = w.float().view(n, k // 128, 128)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp_min(1e-6).half()
    z = (-lo / scales.float()).round().clamp(0, 15)
    q = ((g / scales.float()[..., None]).round() + z[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.view(n, k)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return QuantizedWeight("int4", (n, k), packed, scales, -(z * scales.float()), 128)


def _awq_as_int5(w: torch.Tensor) -> QuantizedWeight:
    """The same values as the int5_g32 tiles run them (fp32 scales and mins per 32)."""
    awq = _awq(w)
    codes = awq.unpacked_int4().view(torch.int8)
    scales = awq.scales.float().repeat_interleave(4, dim=1).contiguous()
    mins = awq.mins.repeat_interleave(4, dim=1).contiguous()
    return QuantizedWeight("int8", awq.shape, codes.contiguous(), scales, mins, 32)


def _weight(fmt: str, w: torch.Tensor) -> QuantizedWeight:
    makers = {"int4": quantize_int4, "q4_0": _q4_0, "q4_k": _q4_k, "q5_k": _q5_k,
              "int8": quantize_int8, "awq": _awq, "awq_int5": _awq_as_int5,
              "q8_0": _q8_0, "q6_k": _q6_k}  # fmt: skip
    return makers[fmt](w)


def _best_us(fn, reps: int) -> float:
    return best_host_us(fn, reps, 3 if FULL else 1)


def _copy_gbs() -> float:
    return host_copy_bandwidth((64 << 20) if FULL else 1 << 16)


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_quant_gemv(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, fmt, n, k in SHAPES:
        w = torch.randn(n, k)
        qw = _weight(fmt, w)
        nbytes = quant_gemv.packed(qw).numel()
        label = f"{name} {fmt} ({quant_gemv.tile_format(qw)})"  # the tiles it runs
        for m in MS:
            if name == "lm_head" and m > MAX_LM_HEAD_M:
                continue
            x = torch.randn(m, k)
            reps = max(2, int(3e8 / (n * k * m))) if FULL else 1
            ours = _best_us(lambda: quant_gemv.quant_gemv(x, qw), reps)  # noqa: B023
            ours8 = _best_us(
                lambda: quant_gemv.quant_gemv(x, qw, activation_bits=8),  # noqa: B023
                reps,
            )
            theirs = _best_us(lambda: torch_int_pack_mm(x, qw), reps)  # noqa: B023
            gbs = f"{nbytes / ours / 1e3:7.1f}" if m == 1 else " " * 7
            line = (
                f"  {label:30s} M={m:<4d} {ours:10.1f} {ours8:10.1f} {theirs:10.1f} {gbs} "
                f"{theirs / ours:9.2f}x {ours / ours8:9.2f}x"
            )
            if AMX and m >= 16:  # the AMX tiles against the VNNI kernels they extend
                vnni = _best_us(
                    lambda: quant_gemv.quant_gemv(x, qw, path="avx512_vnni"),  # noqa: B023
                    reps,
                )
                line += f" {vnni / ours:9.2f}x"
            lines.append(line)
    with capsys.disabled():
        print(
            f"\nCPU quantized GEMM, {THREADS} thread(s), path {quant_gemv.best_path()}, "
            f"copy bandwidth {_copy_gbs():.1f} GB/s; microseconds (best of 3)"
        )
        print(
            f"  {'weight (tiles)':30s} {'M':6s} {'gemv16':>10s} {'gemv8':>10s} {'torch':>10s} "
            f"{'GB/s':>7s} {'torch/gemv16':>10s} {'gemv16/gemv8':>10s}"
            + (f" {'vnni16/gemv16':>10s}" if AMX else "")
        )
        print("\n".join(lines))


# one row over copies of each weight past DRAM_BYTES: read from DRAM, as a decode reads a model
DRAM_BYTES = (768 << 20) if FULL else (1 << 18)
DRAM_SHAPES = (
    [("gate_up", "q4_0", 8192, 2048), ("down", "q4_0", 2048, 8192),
     ("gate_up", "awq", 8192, 2048), ("gate_up", "awq_int5", 8192, 2048),
     ("lm_head", "q6_k", 49152, 2048), ("lm_head", "q8_0", 49152, 1024)]
    if FULL else [("tiny", "q4_0", 64, 256), ("tiny", "q6_k", 64, 256)]
)  # fmt: skip


def _copy(weight: QuantizedWeight) -> QuantizedWeight:
    """weight with its own tensors (and so its own packed tiles, made here)."""
    mins = None if weight.mins is None else weight.mins.clone()
    copy = QuantizedWeight(weight.format, weight.shape, weight.qweight.clone(),
                           weight.scales.clone(), mins, weight.group_size)  # fmt: skip
    quant_gemv.packed(copy)
    return copy


@pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")
def test_cpu_gemv_from_dram(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, fmt, n, k in DRAM_SHAPES:
        first = _weight(fmt, torch.randn(n, k))
        nbytes = quant_gemv.packed(first).numel()
        copies = [first] + [_copy(first) for _ in range(max(1, DRAM_BYTES // nbytes) - 1)]
        x = torch.randn(1, k)

        def every_copy(copies=copies, x=x) -> None:
            for weight in copies:
                quant_gemv.quant_gemv(x, weight)

        us = best_host_us(every_copy, 1, 3 if FULL else 1) / len(copies)
        label = f"{name} {fmt} ({quant_gemv.tile_format(first)}) {n}x{k}"
        lines.append(f"  {label:42s} x{len(copies):<4d} {us:10.1f} {nbytes / us / 1e3:7.1f}")
        # this shape's copies freed before the next's (the closure holds them too)
        del copies, every_copy
    with capsys.disabled():
        print(
            f"\nCPU quantized GEMV from DRAM, one row, {THREADS} thread(s), path "
            f"{quant_gemv.best_path()}, copy bandwidth over {DRAM_BYTES / 2**20:g} MB "
            f"{host_copy_bandwidth(DRAM_BYTES, 2 if FULL else 1):.1f} GB/s (read + written); "
            "microseconds a call (best of 3)"
        )
        print(f"  {'weight (tiles)':42s} {'copies':5s} {'us':>10s} {'GB/s':>7s}")
        print("\n".join(lines))
