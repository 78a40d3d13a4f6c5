"""The int4 weight in the tile order of csrc/quant_gemm_marlin.cu, and the weights that kernel
computes with (the reference it is tested against).

QuantizedWeight's int4 rows (q[n, k], scale and min per group of G along K) become
  qweight uint8 [N / 16, K / 64, 32, 16]: n16 x k64 tiles; in a tile, the 16 bytes of lane l
      (g = l // 4, c = l % 4) hold the lane's mma.sync m16n8k16 B operands for the 4 k16 steps
      and 2 n8 fragments: 32-bit word ks (little-endian) has at bit 16 e + 4 (2 nt + h)
      q[n = 8 nt + g][k = 16 ks + 8 h + 2 c + e], nt, h, e in {0, 1}
  scales, mins [K / G, N] in the activation dtype (the kernel's HFMA2 operands).
The kernel's weight is round_T(q * scale_T + min_T), one rounding (dequantize_marlin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantized_weight import QuantizedWeight

TILE_N = 16 * 4  # the kernel's block tile: 4 warps of 16 columns (csrc kQuantGemmMarlinTileN)
TILE_K = 64
# q[N, K] viewed as [N/16, nt, g, K/64, ks, h, c, e] -> [N/16, K/64, g, c, ks, e, nt, h]
_TO_TILES = (0, 3, 2, 6, 4, 7, 1, 5)
_FROM_TILES = tuple(_TO_TILES.index(i) for i in range(8))


@dataclass(frozen=True, slots=True)
class MarlinInt4:
    qweight: torch.Tensor  # uint8 [N * K / 2], tile order
    scales: torch.Tensor  # [K / G, N], the activation dtype
    mins: torch.Tensor  # [K / G, N]
    shape: tuple[int, int]
    group_size: int


def unsupported_reason(weight: QuantizedWeight) -> str | None:
    """Why the tile-ordered kernel cannot take this weight, or None."""
    n, k = weight.shape
    if weight.format != "int4":
        return f"quant_gemm_marlin takes int4 weights, got {weight.format}"
    if n % TILE_N or k % TILE_K:
        return f"quant_gemm_marlin needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got [{n}, {k}]"
    if weight.group_size not in (32, 128):
        return f"quant_gemm_marlin takes group sizes 32 and 128, got {weight.group_size}"
    return None


def repack_int4(weight: QuantizedWeight, dtype: torch.dtype) -> MarlinInt4:
    """The kernel's operands for `weight` (on its device) with activations of `dtype`."""
    reason = unsupported_reason(weight)
    if reason is not None:
        raise ValueError(reason)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"quant_gemm_marlin takes float16 or bfloat16 activations, got {dtype}")
    n, k = weight.shape
    q = weight.unpacked_int4().view(n // 16, 2, 8, k // 64, 4, 2, 4, 2)
    q = q.permute(*_TO_TILES).contiguous()
    packed = q[..., 0] | (q[..., 1] << 4)  # nibble h = 0 low, h = 1 high: byte 2 e + nt
    return MarlinInt4(
        qweight=packed.reshape(-1),
        scales=weight.scales.t().to(dtype).contiguous(),
        mins=weight.mins.t().to(dtype).contiguous(),
        shape=(n, k),
        group_size=weight.group_size,
    )


def unpack_int4(packed: MarlinInt4) -> torch.Tensor:
    """q as uint8 [N, K] (0..15) from the tile order: the inverse of repack_int4's weights."""
    n, k = packed.shape
    b = packed.qweight.view(n // 16, k // 64, 8, 4, 4, 2, 2)
    q = torch.stack([b & 15, b >> 4], dim=-1)  # [..., ks, e, nt, h]
    return q.permute(*_FROM_TILES).reshape(n, k)


def dequantize_marlin(packed: MarlinInt4) -> torch.Tensor:
    """The kernel's [N, K] weight in the activation dtype: round(q * scale + min), in fp32 (exact
    for the products; the sum rounds once to the dtype as the kernel's HFMA2 does, except in
    extreme exponent gaps)."""
    n, k = packed.shape
    g = packed.group_size
    q = unpack_int4(packed).float().view(n, k // g, g)
    s = packed.scales.t().float()[..., None]
    m = packed.mins.t().float()[..., None]
    return (q * s + m).to(packed.scales.dtype).view(n, k)
