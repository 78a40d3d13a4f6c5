"""GGUF Q4_K blocks from float weights, for tests (the gguf package dequantizes Q4_K but has no
quantizer). llama.cpp's layout, its rounding simplified: per 32 weights a scale (max - min) / 15
and a min (the group's, at most 0), each a 6-bit multiple of an fp16 d / dmin per 256 whose
largest is 63; w = d sc q - dmin m, q in 0..15."""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = 144  # d, dmin fp16; 12 bytes of 6-bit sc and m; 128 bytes of nibbles


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] (K a multiple of 256) as Q4_K bytes [rows, K / 256 * 144] uint8."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # super-blocks x groups x weights
    lo = np.minimum(x.min(-1), 0)
    group_scale, group_min = (x.max(-1) - lo) / 15, -lo

    def two_level(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = (values.max(-1) / 63).astype(np.float16)
        d32 = d.astype(np.float32)[:, None]
        c = np.clip(np.rint(values / np.where(d32 == 0, 1, d32)), 0, 63).astype(np.uint8)
        return d, c

    d, sc = two_level(group_scale)
    dmin, m = two_level(group_min)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.rint((x + offset[..., None]) / np.where(scale == 0, 1, scale)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    out = np.zeros((x.shape[0], BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    packed = out[:, 4:16]  # get_scale_min_k4's layout
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    # 4 chunks of 32 bytes: chunk c holds group 2c in the low nibbles, group 2c + 1 in the high
    out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    return out.reshape(rows, k // 256 * BLOCK_BYTES)
