"""Weight-only quantized GEMM (ops.quant_linear on torch's CPU int-pack kernels) against the
float64 dequantize-then-matmul reference, the formats' round trips, and GGUF block mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedkern import ops
from pagedkern.model.quantized_linear import (
    CODES_BLOCK_BYTES,
    QuantizedWeight,
    cat_rows,
    gguf_to_int4,
    gguf_to_int8,
    quantize_int4,
    quantize_int8,
)
from pagedkern.ops.cpu import quant_gemv
from pagedkern.reference.quant_gemm import dequantize as ref_dequantize
from pagedkern.reference.quant_gemm import quant_linear as ref_quant_linear

FORMATS = [("int8", 0), ("int4", 32), ("int4", 128)]


@pytest.fixture(autouse=True)
def _torch_int_pack():
    """These tests are of torch's int-pack path, which the reference backend runs (the CPU
    backend's own GEMV: tests/test_cpu_backend_quant_gemv.py)."""
    with ops.use_backend("reference"):
        yield


def make(fmt: str, group: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, QuantizedWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)
    return w, quantize_int8(w) if fmt == "int8" else quantize_int4(w, group)


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 960, 768), (3, 72, 256), (17, 48, 384), (64, 16, 128)])
def test_quant_linear_matches_float64_reference(fmt, group, m, n, k):
    """The kernel sees bf16 x and bf16 scales/zeros; given those, its output equals the float64
    product up to fp32 accumulation and the final bf16 rounding (half an ulp: 2^-9 relative)."""
    w, qw = make(fmt, group, n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    got = ops.quant_linear(x, qw)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    want = ref_quant_linear(x.bfloat16().double(), qw, kernel_scales=torch.bfloat16)
    # bf16 output: |err| <= 2^-9 |y| (rounding) + fp32 accumulation slack over K terms
    terms = x.bfloat16().double().abs() @ ref_dequantize(qw).abs().T
    bound = want.abs() * 2**-8 + terms * k * 2**-24 + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    # and it stands for the float weight within quantization noise: a uniform error of half a
    # step has rms step/sqrt(12) ~ (6 sigma / levels) / 3.5, i.e. ~0.4% (int8), ~11% (int4)
    exact = x.double() @ w.double().T
    rel = (got.double() - exact).norm() / exact.norm()
    assert rel < (0.01 if fmt == "int8" else 0.16)


def test_quant_linear_bias_and_empty():
    _, qw = make("int4", 32, 32, 64, 0)
    x = torch.randn(2, 64)
    bias = torch.randn(32)
    assert torch.allclose(ops.quant_linear(x, qw, bias), ops.quant_linear(x, qw) + bias)
    assert ops.quant_linear(x[:0], qw).shape == (0, 32)


def test_quant_linear_validates_arguments():
    _, qw = make("int8", 0, 32, 64, 0)
    with pytest.raises(ValueError, match="K must equal"):
        ops.quant_linear(torch.randn(2, 32), qw)
    with pytest.raises(ValueError, match="2-D float"):
        ops.quant_linear(torch.randn(2, 64).long(), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        ops.quant_linear(torch.randn(2, 64), torch.randn(32, 64))
    with pytest.raises(ValueError, match="bias"):
        ops.quant_linear(torch.randn(2, 64), qw, torch.randn(31))
    with pytest.raises(ValueError, match="K % 32"):
        quantize_int8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(4, 96), 128)


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_round_trip_error_within_half_a_step(fmt, group):
    w, qw = make(fmt, group, 64, 256, 1)
    err = (qw.dequantize_rows().double() - w.double()).abs()
    if fmt == "int8":
        step = qw.scales.double()[:, None]
    else:
        step = qw.scales.double().repeat_interleave(group, dim=1)
    # half a step, plus the fp16 rounding of scale and min (int4) at up to 15 steps
    slack = 0 if fmt == "int8" else 16 * 2**-11 * step + 2**-11 * w.abs().double()
    assert (err <= step / 2 + slack + 1e-7).all()


def test_rows_state_dict_and_fusion():
    _, a = make("int4", 32, 32, 64, 2)
    _, b = make("int4", 32, 16, 64, 3)
    fused = cat_rows([a, b])
    assert fused.shape == (48, 64)
    assert torch.equal(fused.dequantize_rows()[32:], b.dequantize_rows())
    ids = torch.tensor([40, 1, 1])
    assert torch.equal(fused.dequantize_rows(ids), fused.dequantize_rows()[ids])
    back = QuantizedWeight.from_state_dict("w", fused.state_dict("w"))
    assert torch.equal(back.dequantize_rows(), fused.dequantize_rows())
    _, c = make("int8", 0, 8, 64, 4)
    with pytest.raises(ValueError, match="share format"):
        cat_rows([a, c])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_map_exactly_onto_int4(kind):
    """Q4_0 / Q4_1 / Q4_K bytes -> int4 without fp32 weights: dequantizing the result gives
    gguf's own dequantization exactly (Q4_K's d*sc and dmin*m in fp32, which fp16 cannot hold),
    and the CPU GEMM keeps those values (Q4_K: the int4_k tiles)."""
    qtype = GGMLQuantizationType[kind]
    n, k = 24, 512
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    try:
        raw = quantize(w, qtype)
    except NotImplementedError:
        raw = _q4k_blocks(rng, n, k)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    qw = gguf_to_int4(kind, raw, n, k)
    assert qw is not None and qw.format == "int4" and qw.group_size == 32
    got = qw.dequantize_rows().double()
    assert torch.equal(got, want)
    assert qw.scales.dtype == (torch.float32 if kind == "Q4_K" else torch.float16)
    assert gguf_to_int4("Q8_0", raw, n, k) is None
    if not quant_gemv.available():
        return
    assert (
        quant_gemv.tile_format(qw) == {"Q4_0": "int4_sym", "Q4_1": "int4", "Q4_K": "int4_k"}[kind]
    )
    x = torch.randn(3, k)
    exact = x.double() @ want.T
    got = quant_gemv.quant_gemv(x, qw).double()
    assert (got - exact).abs().max() <= 1e-4 * (x.double().abs() @ want.abs().T).max()


@pytest.mark.parametrize("n", [24, 1030])  # 1030: more rows than one conversion chunk
def test_gguf_q8_0_maps_exactly_onto_int8_per_32(n):
    """Q8_0 bytes -> int8 with the block's d as the scale of each 32: gguf's dequantization
    exactly; a tensor holding -128 (which llama.cpp never writes) is requantized per channel,
    as quantize_int8 gives for the dequantized tensor."""
    k = 96
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 1, (n, 1))
    w[3] *= np.repeat(rng.uniform(0.1, 10, k // 32), 32).astype(np.float32)  # block scales vary
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(n, k))
    qw = gguf_to_int8("Q8_0", raw, n, k)
    assert qw is not None and (qw.format, qw.shape, qw.group_size) == ("int8", (n, k), 32)
    assert torch.equal(qw.dequantize_rows(), want)
    assert gguf_to_int8("Q4_1", raw, n, k) is None
    blocks = raw.reshape(n, k // 32, 34).copy()
    blocks[5, 1, 2] = 0x80  # a -128
    raw = blocks.reshape(n, -1)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(n, k))
    qw = gguf_to_int8("Q8_0", raw, n, k)
    detour = quantize_int8(want)
    assert (qw.format, qw.group_size) == ("int8", 0)
    assert torch.equal(qw.qweight, detour.qweight) and torch.equal(qw.scales, detour.scales)


def _q6k_blocks(rng, n: int, k: int) -> np.ndarray:
    """Random valid Q6_K bytes (gguf has no Q6_K quantizer): random 6-bit q and int8 scales,
    a finite fp16 d (zero in one block: its weights are all 0)."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    d = rng.uniform(-1e-3, 1e-3, size=blocks.shape[0]).astype(np.float16)
    d[1] = 0
    blocks[:, -2:] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("n", [3, 1030])
def test_gguf_q6_k_maps_exactly_onto_int8_per_16(n):
    """Q6_K bytes -> int8 q - 32 with d * sc as the scale of each 16: gguf's dequantization
    exactly, and the CPU GEMM over it within the 16-bit activations' rounding."""
    k = 512
    raw = _q6k_blocks(np.random.default_rng(n), n, k)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).reshape(n, k))
    qw = gguf_to_int8("Q6_K", raw, n, k)
    assert qw is not None and (qw.format, qw.shape, qw.group_size) == ("int8", (n, k), 16)
    assert qw.qweight.min() >= -32 and qw.qweight.max() <= 31
    assert torch.equal(qw.dequantize_rows(), want)
    assert gguf_to_int8("Q6_K", raw[:, :105], n, 128) is None  # K not whole 256-blocks
    if not quant_gemv.available():
        return
    x = torch.randn(2, k)
    got = quant_gemv.quant_gemv(x, qw).double()
    exact = x.double() @ want.double().T
    assert (got - exact).abs().max() <= 1e-4 * (x.double().abs() @ want.double().abs().T).max()


def _q5k_blocks(rng, n: int, k: int) -> np.ndarray:
    """Random valid Q5_K bytes (gguf has no Q5_K quantizer): finite fp16 d / dmin (d zero in
    one block), random 6-bit scales and mins, nibbles and fifth bits."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 176), dtype=np.uint8)
    d = rng.uniform(-1e-2, 1e-2, size=(blocks.shape[0], 2)).astype(np.float16)
    d[1, 0] = 0
    blocks[:, :4] = d.view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("n", [5, 1030])  # 1030: more rows than one conversion chunk
def test_gguf_q5_maps_exactly_onto_int8_codes_with_mins(kind, n):
    """Q5_0 / Q5_1 / Q5_K bytes -> int8 codes 0..31 with an fp32 scale and min per 32: gguf's
    dequantization bit for bit, and the CPU GEMM over it (int5_g32 tiles) within the 16-bit
    activations' rounding."""
    k, rng = 512, np.random.default_rng(n)
    qtype = GGMLQuantizationType[kind]
    if kind == "Q5_K":
        raw = _q5k_blocks(rng, n, k)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 1, (n, 1))
        w[2] += 0.5  # Q5_1: a min far from zero
        raw = quantize(w, qtype)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    qw = gguf_to_int8(kind, raw, n, k)
    assert qw is not None and (qw.format, qw.shape, qw.group_size) == ("int8", (n, k), 32)
    assert qw.mins is not None and qw.mins.shape == qw.scales.shape == (n, k // 32)
    assert qw.qweight.min() >= 0 and qw.qweight.max() <= 31
    assert torch.equal(qw.dequantize_rows(), want)
    if kind == "Q5_K":
        assert gguf_to_int8(kind, raw[:, :88], n, 128) is None  # K not whole 256-blocks
    if not quant_gemv.available():
        return
    assert quant_gemv.tile_format(qw) == "int5_g32"
    x = torch.randn(3, k)
    got = quant_gemv.quant_gemv(x, qw).double()
    exact = x.double() @ want.double().T
    assert (got - exact).abs().max() <= 1e-4 * (x.double().abs() @ want.double().abs().T).max()


def _q4k_blocks(rng, n: int, k: int) -> np.ndarray:
    """Random valid Q4_K bytes (gguf has no Q4_K quantizer): positive fp16 d/dmin, random 6-bit
    scales and nibbles."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, size=(blocks.shape[0], 2)).astype(np.float16)
    blocks[:, :4] = d.view(np.uint8)
    return blocks.reshape(n, -1)


def test_int8_weight_not_64_byte_aligned_is_realigned():
    """torch's int8 CPU kernel reads out of bounds (segfaults at M > 1) on weights that do not
    start on a 64-byte boundary, e.g. tensors inside a loaded safetensors file."""
    _, qw = make("int8", 0, 960, 576, 7)
    buffer = torch.empty(qw.qweight.numel() + 40, dtype=torch.int8)
    shifted = buffer[40:].view(qw.qweight.shape).copy_(qw.qweight)
    assert shifted.data_ptr() % 64
    moved = QuantizedWeight("int8", qw.shape, shifted, qw.scales)
    x = torch.randn(7, 576)
    assert torch.equal(ops.quant_linear(x, moved), ops.quant_linear(x, qw))


def _code_blocks(rng, kind: str, n: int, k: int) -> np.ndarray:
    """Random valid Q3_K / IQ4_XS / IQ4_NL bytes (gguf has no quantizer for them): random
    codes and 6-bit scales, a finite fp16 d (zero in one block: its weights are all 0)."""
    block_bytes, _ = CODES_BLOCK_BYTES[kind]
    per_block = 32 if kind == "IQ4_NL" else 256
    blocks = rng.integers(0, 256, size=(n * k // per_block, block_bytes), dtype=np.uint8)
    d = rng.uniform(-1e-2, 1e-2, size=blocks.shape[0]).astype(np.float16)
    d[1] = 0
    at = slice(-2, None) if kind == "Q3_K" else slice(0, 2)
    blocks[:, at] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q3_K", "IQ4_XS", "IQ4_NL"])
@pytest.mark.parametrize("n", [3, 1030])  # 1030: more rows than one conversion chunk
def test_gguf_codebook_blocks_map_exactly_onto_int8(kind, n):
    """Q3_K (codes -4..3 times a scale per 16) and the IQ4 codebooks (IQ4_NL's 16 int8 values
    times a scale per 32) -> int8 codes with an fp32 scale per group: gguf's dequantization bit
    for bit, and the CPU GEMM over it within the 16-bit activations' rounding."""
    k, rng = 512, np.random.default_rng(n)
    qtype = GGMLQuantizationType[kind]
    raw = _code_blocks(rng, kind, n, k)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    qw = gguf_to_int8(kind, raw, n, k)
    group = 16 if kind == "Q3_K" else 32
    assert qw is not None and (qw.format, qw.shape, qw.group_size) == ("int8", (n, k), group)
    assert qw.mins is None and not want.isnan().any()
    assert torch.equal(qw.dequantize_rows(), want)
    if kind != "IQ4_NL":
        assert gguf_to_int8(kind, raw[:, : raw.shape[1] // 4], n, 128) is None  # K < 256
    if not quant_gemv.available():
        return
    x = torch.randn(3, k)
    got = quant_gemv.quant_gemv(x, qw).double()
    exact = x.double() @ want.double().T
    assert (got - exact).abs().max() <= 1e-4 * (x.double().abs() @ want.double().abs().T).max()
