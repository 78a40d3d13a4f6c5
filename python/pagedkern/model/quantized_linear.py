"""Weight-only quantized linear weights: quantize-at-load and the GGUF block mapping onto the
QuantizedWeight format (an operand format of the ops, defined with the reference in
reference/quantized_weight.py, reached through ops.quant_gemm).

GGUF Q4_0 (w = d*(q-8)), Q4_1 (w = d*q + m) and Q4_K (w = d*sc*q - dmin*m per 32 weights) map
exactly onto int4 with G = 32 by rearranging nibbles and scales, never through fp32 weights
(Q4_K's d*sc and dmin*m as fp32 scales and mins: their 17 significant bits do not fit fp16).
Q8_0 and Q6_K map exactly onto int8 with a scale per 32 and per 16 weights, Q5_0, Q5_1 and Q5_K onto
int8 codes 0..31 with a scale and a min per 32 (gguf_to_int8).
Kernel-specific packed forms (torch's CPU int4pack, bf16 scales) are built once per weight by
ops.quant_gemm and kept in `packed`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ops.quant_gemm import QuantizedWeight

MODES = ("none", "int8", "int4")

# quant_gemm.cu against bf16 torch.mm, microseconds, on one H200 (the first GPU run, 2026-12-04,
# bench/test_bench_quant_gemm.py): (N, K) -> {M: (fastest quantized format, bf16 torch.mm)}.
QUANT_GEMM_MEASURED = {
    (4096, 4096): {1: (17.9, 25.4), 4: (34.6, 34.0), 16: (102.8, 30.9), 64: (390.6, 24.4)},
    (14336, 4096): {1: (61.8, 38.9), 4: (65.3, 40.0), 16: (222.0, 39.8), 64: (854.3, 42.4)},
    (4096, 14336): {1: (66.4, 40.5), 4: (98.4, 39.5), 16: (385.1, 41.4), 64: (1509.8, 43.4)},
}


def quant_gemm_wins(m: int, n: int, k: int) -> bool:
    """Whether quant_gemm.cu beat a bf16 GEMM at this shape as measured (QUANT_GEMM_MEASURED):
    only at M = 1 on weights of at most 4096 x 4096 elements, where bf16 torch.mm is
    launch-bound (25 us); at M >= 4, and at M = 1 on the 14336-wide weights, bf16 was faster
    (1.02-35x). Smaller weights than those measured are taken to behave like 4096 x 4096."""
    return m == 1 and n * k <= 4096 * 4096


INT4_GROUP_SIZES = (32, 128)
DEFAULT_INT4_GROUP = 32


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fuse weights along the output dimension (QKV, gate/up): same format, K, group and input
    order (act-order's input_index)."""
    first = parts[0]
    kind = (first.format, first.shape[1], first.group_size)
    if any((p.format, p.shape[1], p.group_size) != kind for p in parts):
        raise ValueError("fused weights must share format, in-features and group size")
    if not all(_same_index(p.input_index, first.input_index) for p in parts):
        raise ValueError("fused weights must share their input order (act-order input_index)")
    mins = None if first.mins is None else _joined([p.mins for p in parts], torch.cat)
    rows = sum(p.shape[0] for p in parts)
    return QuantizedWeight(
        first.format,
        (rows, first.shape[1]),
        torch.cat([p.qweight for p in parts]),
        _joined([p.scales for p in parts], torch.cat),
        mins,
        first.group_size,
        input_index=first.input_index,
    )


def _same_index(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _joined(tensors: list[torch.Tensor], join) -> torch.Tensor:
    """Scales or mins joined by `join` (torch.cat / torch.stack); fp16 beside fp32 (a Q4_0 or
    Q4_1 part beside a Q4_K one) in fp32, which holds both exactly."""
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.float() for t in tensors]
    return join(tensors)


def permute_rows(qw: QuantizedWeight, permute) -> QuantizedWeight:
    """Apply a row permutation function (e.g. GGUF's Q/K un-permutation) to every part."""
    mins = None if qw.mins is None else permute(qw.mins)
    return QuantizedWeight(
        qw.format, qw.shape, permute(qw.qweight), permute(qw.scales), mins, qw.group_size,
        input_index=qw.input_index,
    )  # fmt: skip


def stack_experts(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Experts' [N, K] weights (same format, shape and group) as one stacked [E, N, K] weight."""
    first = parts[0]
    kind = (first.format, tuple(first.shape), first.group_size)
    if any((p.format, tuple(p.shape), p.group_size) != kind for p in parts):
        raise ValueError("stacked experts must share format, shape and group size")
    if any(p.input_index is not None for p in parts):
        raise ValueError("stacked experts take no input order (act-order input_index)")
    mins = None if first.mins is None else _joined([p.mins for p in parts], torch.stack)
    return QuantizedWeight(
        first.format,
        (len(parts), *first.shape),
        torch.stack([p.qweight for p in parts]),
        _joined([p.scales for p in parts], torch.stack),
        mins,
        first.group_size,
    )


def as_experts(qw: QuantizedWeight, experts: int) -> QuantizedWeight:
    """A [E * N, K] weight (stacked experts' rows, one after the other) as [E, N, K]."""
    rows, k = qw.shape
    n = rows // experts

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(experts, n, *t.shape[1:])

    mins = None if qw.mins is None else split(qw.mins)
    return QuantizedWeight(
        qw.format, (experts, n, k), split(qw.qweight), split(qw.scales), mins, qw.group_size
    )


def quantizable(k: int, mode: str, group_size: int = DEFAULT_INT4_GROUP) -> bool:
    """Whether weights of k in-features can be held in `mode` (int8: K % 32; int4: K % G)."""
    return k % (group_size if mode == "int4" else K_MULTIPLE) == 0 and k % K_MULTIPLE == 0


def quantize_experts(
    w: torch.Tensor, mode: str, group_size: int = DEFAULT_INT4_GROUP
) -> QuantizedWeight:
    """Stacked float experts [E, N, K] in `mode`, each row quantized as quantize() does it."""
    e, n, k = w.shape
    return as_experts(quantize(w.reshape(e * n, k), mode, group_size), e)


K_MULTIPLE = 32  # in-features of every quantized weight (torch's int8 CPU kernel needs 16)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 (scale = max|w| / 127), computed in fp32."""
    if w.dim() != 2 or w.shape[1] % K_MULTIPLE:
        raise ValueError(
            f"int8 weights must be [N, K] with K % {K_MULTIPLE} == 0, got {tuple(w.shape)}"
        )
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", tuple(w.shape), q.contiguous(), scales.contiguous())


def quantize_int8_grouped(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Symmetric int8 with a scale per group of `group_size` along K (max|w| / 127 of the group,
    GGUF Q8_0's form at 32), computed in fp32."""
    n, k = w.shape
    if group_size not in (16, 32) or k % group_size:
        raise ValueError(f"int8 group size {group_size} must be 16 or 32 and divide {k}")
    g = w.float().view(n, k // group_size, group_size)
    scales = (g.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    q = torch.round(g / scales[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight("int8", (n, k), q.contiguous(), scales.contiguous(), None, group_size)


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP) -> QuantizedWeight:
    """Asymmetric group-wise int4: per group of `group_size` weights along K, scale = (max -
    min) / 15 and min, both stored fp16; q = round((w - min) / scale) in 0..15."""
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(
            f"int4 group size {group_size} must be in {INT4_GROUP_SIZES} and divide {k}"
        )
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp_min(1e-8).half()
    mins = lo.half()
    q = torch.round((g - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return int4_from_codes(q.to(torch.uint8).view(n, k), scales, mins, group_size)


def int4_from_codes(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int
) -> QuantizedWeight:
    """An int4 QuantizedWeight from codes q [N, K] uint8 (0..15), packed two a byte."""
    n, k = q.shape
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return QuantizedWeight("int4", (n, k), packed, scales.contiguous(), mins.contiguous(), group)


def quantize(w: torch.Tensor, mode: str, group_size: int = DEFAULT_INT4_GROUP) -> QuantizedWeight:
    if mode == "int8":
        return quantize_int8(w)
    if mode == "int4":
        return quantize_int4(w, group_size)
    raise ValueError(f"quantization must be one of {MODES[1:]}, got {mode!r}")


# --- GGUF blocks -> int4 (no fp32 weights in between) ---------------------------------------


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes per 32 weights (weight j in the low nibble of byte j, weight j+16 in the
    high nibble) -> q values [blocks, 32] uint8."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_to_int4(tensor_type: str, data: np.ndarray, n: int, k: int) -> QuantizedWeight | None:
    """A GGUF Q4_0 / Q4_1 / Q4_K tensor's raw bytes ([n, bytes per row] uint8) as int4 with
    G = 32, exactly (Q4_K's scales and mins in fp32, the others' in fp16), or None for other
    types."""
    blocks = np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES.get(tensor_type, 1))
    if tensor_type == "Q4_0":  # d fp16, 16 bytes: w = d * (q - 8)
        d = blocks[:, :2].view(np.float16)[:, 0]
        q, scales, mins = _nibbles_32(blocks[:, 2:]), d, -8 * d.astype(np.float32)
    elif tensor_type == "Q4_1":  # d, m fp16, 16 bytes: w = d * q + m
        d, m = blocks[:, :2].view(np.float16)[:, 0], blocks[:, 2:4].view(np.float16)[:, 0]
        q, scales, mins = _nibbles_32(blocks[:, 4:]), d, m
    elif tensor_type == "Q4_K":  # 256 weights: d, dmin fp16, 12 bytes of 6-bit sc/m, 128 bytes
        from gguf.quants import Q4_K

        d = blocks[:, :2].view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scales, mins = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
        # 128 bytes = 4 chunks of 32 bytes; chunk c holds sub-blocks 2c (low) and 2c+1 (high).
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 32)
    else:
        return None
    q = torch.from_numpy(np.ascontiguousarray(q)).view(n, k)
    groups, dtype = k // 32, np.float32 if tensor_type == "Q4_K" else np.float16
    scales = torch.from_numpy(np.ascontiguousarray(scales, dtype=dtype)).view(n, groups)
    mins = torch.from_numpy(np.ascontiguousarray(mins, dtype=dtype)).view(n, groups)
    return int4_from_codes(q, scales, mins, 32)


_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
Q8_0_BLOCK_BYTES = 34  # d fp16, 32 int8: w = d * q
Q6_K_BLOCK_BYTES = 210  # 256 weights: 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, d fp16
ROWS_PER_CHUNK = 1024  # gguf_to_int8: rows converted at a time (bounds the temporaries)


def gguf_to_int8(tensor_type: str, data: np.ndarray, n: int, k: int) -> QuantizedWeight | None:
    """A GGUF Q8_0, Q6_K, Q5_*, Q3_K or IQ4_* tensor's raw bytes ([n, bytes per row] uint8) as
    int8 with a scale per group, exactly, or None for other types: Q8_0 (w = d q, d fp16 per
    32) is int8 G = 32 with scale d; Q6_K (w = d sc (q - 32), q 6 bits, sc int8 per 16, d fp16
    per 256) is int8 G = 16 with q - 32 and scale d sc (exact in fp32: 11 x 8 bits); Q5_0 /
    Q5_1 / Q5_K are codes 0..31 with a scale and a min per 32 (gguf_q5_to_int8); Q3_K and the
    IQ4 codebooks are gguf_codes_to_int8's. A Q8_0 tensor holding -128 (llama.cpp writes
    -127..127; the kernels' sign trick needs it) is requantized per channel instead, as
    quantize_int8 would the dequantized tensor."""
    if k % 256 if tensor_type in ("Q6_K", "Q5_K", *SUPER_BLOCK_CODES) else k % 32:
        return None
    if tensor_type in Q5_BLOCK_BYTES:
        return gguf_q5_to_int8(tensor_type, data, n, k)
    if tensor_type in CODES_BLOCK_BYTES:
        return gguf_codes_to_int8(tensor_type, data, n, k)
    if tensor_type == "Q8_0":
        blocks = np.ascontiguousarray(data).reshape(n, k // 32, Q8_0_BLOCK_BYTES)
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)
        if bool((q == -128).any()):
            return _q8_0_per_channel(blocks, n, k)
        d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)).reshape(n, k // 32)
        return QuantizedWeight("int8", (n, k), q.contiguous(), d.float().contiguous(), None, 32)
    if tensor_type == "Q6_K":
        from gguf.quants import Q6_K

        rows = np.ascontiguousarray(data).reshape(n * (k // 256), Q6_K_BLOCK_BYTES)
        q = torch.empty(n * (k // 256), 256, dtype=torch.int8)
        scales = torch.empty(n * (k // 256), 16, dtype=torch.float32)
        for start in range(0, rows.shape[0], ROWS_PER_CHUNK):
            part = rows[start : start + ROWS_PER_CHUNK]
            d = torch.from_numpy(part[:, -2:].copy().view(np.float16)).float()  # [b, 1]
            sc = torch.from_numpy(part[:, -18:-2].copy().view(np.int8)).float()  # [b, 16]
            dq = Q6_K.dequantize_blocks(part)  # d sc (q - 32), exact in fp32
            scale = d * sc
            q_part = dq.reshape(-1, 16, 16) / np.where(scale == 0, 1.0, scale.numpy())[..., None]
            q[start : start + len(part)] = (
                torch.from_numpy(np.rint(q_part)).reshape(-1, 256).to(torch.int8)
            )
            scales[start : start + len(part)] = scale
        return QuantizedWeight(
            "int8", (n, k), q.view(n, k).contiguous(), scales.view(n, k // 16), None, 16
        )
    return None


Q5_BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q5_K": 176}
# Blocks whose weights are a small signed code times a scale per 16 or 32: (bytes, group)
CODES_BLOCK_BYTES = {"Q3_K": (110, 16), "IQ4_XS": (136, 32), "IQ4_NL": (18, 32)}
SUPER_BLOCK_CODES = ("Q3_K", "IQ4_XS")  # (in 256-weight super-blocks)


def gguf_codes_to_int8(tensor_type: str, data: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """Q3_K (w = d (sc - 32) q per 16, q in -4..3, sc 6 bits, d fp16 per 256), IQ4_XS (w = d
    (ls - 32) kv[i] per 32, ls 6 bits, kv IQ4_NL's 16 int8 values) and IQ4_NL (w = d kv[i],
    d fp16 per 32) as int8 codes (q, kv[i]) with an fp32 scale per group (d (sc - 32), d):
    every scale exact in fp32 (11 x 6 bits) and so every w, which gguf's dequantization gives,
    so the codes are w / scale exactly. ROWS_PER_CHUNK rows at a time."""
    import gguf.quants

    block_bytes, group = CODES_BLOCK_BYTES[tensor_type]
    quant = getattr(gguf.quants, tensor_type)
    rows = np.ascontiguousarray(data).reshape(n, -1)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group, dtype=torch.float32)
    for start in range(0, n, ROWS_PER_CHUNK):
        blocks = rows[start : start + ROWS_PER_CHUNK].reshape(-1, block_bytes)
        values = quant.dequantize_blocks(blocks).reshape(-1, group)
        scale = _codes_scales(tensor_type, blocks).reshape(-1, 1)
        codes = np.rint(values / np.where(scale == 0, 1.0, scale))
        stop = min(start + ROWS_PER_CHUNK, n)
        q[start:stop] = torch.from_numpy(codes.astype(np.int8)).reshape(-1, k)
        scales[start:stop] = torch.from_numpy(scale.astype(np.float32)).reshape(-1, k // group)
    return QuantizedWeight("int8", (n, k), q, scales, None, group)


def _codes_scales(tensor_type: str, blocks: np.ndarray) -> np.ndarray:
    """The fp32 scale of each group of `blocks` [b, bytes] (gguf_codes_to_int8), [b, groups]."""
    if tensor_type == "IQ4_NL":
        return blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if tensor_type == "IQ4_XS":  # d, scales_h (2 bits a group), scales_l (4 bits a group)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        high = blocks[:, 2:4].copy().view(np.uint16).astype(np.int32)
        high = (high >> np.arange(0, 16, 2)) & 3
        low = blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)
        low = (low.reshape(-1, 8) & 0x0F).astype(np.int32)
        return d * ((low | (high << 4)) - 32).astype(np.float32)
    # Q3_K: hmask 32, qs 64, then 12 bytes of 6-bit scales, d
    d = blocks[:, -2:].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 96:108]
    low = (packed[:, :8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 2, 1)
    high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 2, 1)
    six = (low.reshape(-1, 16) & 0x0F) | ((high.reshape(-1, 16) & 3) << 4)
    return d * (six.astype(np.int32) - 32).astype(np.float32)


def gguf_q5_to_int8(tensor_type: str, data: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """Q5_0 (w = d (q - 16)), Q5_1 (w = d q + m) or Q5_K (w = d sc q - dmin mn per 32, sc and
    mn 6 bits, d and dmin fp16 per 256) as int8 codes q (0..31) with fp32 scales and mins per
    32: (d, -16 d), (d, m), (d sc, -dmin mn), every one exact in fp32, so w = s q + m is the
    file's value bit for bit. ROWS_PER_CHUNK rows at a time (bounds the temporaries)."""
    rows = np.ascontiguousarray(data).reshape(n, -1)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // 32, dtype=torch.float32)
    mins = torch.empty(n, k // 32, dtype=torch.float32)
    for start in range(0, n, ROWS_PER_CHUNK):
        blocks = rows[start : start + ROWS_PER_CHUNK].reshape(-1, Q5_BLOCK_BYTES[tensor_type])
        part_q, part_s, part_m = _q5_blocks(tensor_type, blocks)
        stop = min(start + ROWS_PER_CHUNK, n)
        q[start:stop] = torch.from_numpy(part_q.view(np.int8)).reshape(-1, k)
        scales[start:stop] = torch.from_numpy(part_s.astype(np.float32)).reshape(-1, k // 32)
        mins[start:stop] = torch.from_numpy(part_m.astype(np.float32)).reshape(-1, k // 32)
    return QuantizedWeight("int8", (n, k), q, scales, mins, 32)


def _q5_blocks(tensor_type: str, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """(codes [groups, 32] uint8, scales, mins [groups]) of Q5_* blocks."""

    def half(at: int) -> np.ndarray:
        return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0]

    if tensor_type == "Q5_K":
        from gguf.quants import Q4_K

        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scales = half(0)[:, None] * sc.astype(np.float32)
        mins = -(half(2)[:, None] * mn.astype(np.float32))
        qh = blocks[:, 16:48]  # bit s of byte l: weight l of sub-block s's fifth bit
        qs = blocks[:, 48:].reshape(-1, 4, 1, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        return (low | (fifth << 4)).reshape(-1, 32), scales.reshape(-1), mins.reshape(-1)
    at = 2 if tensor_type == "Q5_0" else 4  # (Q5_1: d, m, then the fifth bits)
    high = blocks[:, at : at + 4].copy().view(np.uint32)[:, 0]  # bit j: weight j's fifth bit
    fifth = ((high[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles_32(blocks[:, at + 4 :]) | (fifth << 4)
    d = half(0)
    return q, d, -16 * d if tensor_type == "Q5_0" else half(2)


def _q8_0_per_channel(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """Q8_0 blocks [n, K/32, 34] as per-channel int8: row scale = max |d q| / 127 (d q exact in
    fp32), q' = round(d q / scale), ROWS_PER_CHUNK rows at a time."""
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, ROWS_PER_CHUNK):
        part = blocks[start : start + ROWS_PER_CHUNK]
        d = torch.from_numpy(part[..., :2].copy().view(np.float16)).float()  # [rows, K/32, 1]
        qs = torch.from_numpy(part[..., 2:].copy().view(np.int8))  # [rows, K/32, 32]
        w = qs.float() * d
        row = (w.abs().amax(dim=(1, 2)) / 127.0).clamp_min(1e-12)
        scales[start : start + len(part)] = row
        q[start : start + len(part)] = (
            torch.round(w / row[:, None, None]).clamp_(-127, 127).view(-1, k).to(torch.int8)
        )
    return QuantizedWeight("int8", (n, k), q, scales)
