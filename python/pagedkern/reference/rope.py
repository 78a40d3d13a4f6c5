"""Rotary position embedding (rotate-half convention) fused with the paged KV-cache write."""

from __future__ import annotations

import torch


def cos_sin_cache(
    head_dim: int,
    max_positions: int,
    base: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: row p = [cos(p * f_i) for i < D/2] + [sin(p * f_i)].

    f_i = base^(-2i/D) unless `inv_freq` ([D/2], e.g. Llama 3 scaled frequencies) is given, so
    every frequency scheme reaches the kernels through this table.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if inv_freq is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
        inv_freq = base**-exponents
    angles = torch.outer(
        torch.arange(max_positions, dtype=torch.float64, device=device),
        inv_freq.to(device=device, dtype=torch.float64),
    )
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The fp8 KV-cache write, the one definition the kernel (csrc/fp8.cuh) follows bit for bit:
    fp32 x times fp32(1 / scale), then round to nearest even into float8_e4m3fn, saturating:
    |x / scale| beyond 448 (inf included) becomes +-448 (a plain cast would give NaN), -0.0 stays
    -0.0, subnormals (spacing 2^-9) are kept. NaN stays NaN (torch keeps its sign, 0x7F / 0xFF;
    the CUDA conversion always writes 0x7F)."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _rotate_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Rotate q and k in place and write k and v into their cache pages.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (views into a fused QKV output are fine);
    positions: [T] int; cos_sin: [max_positions, D] float32 from `cos_sin_cache`;
    k_cache, v_cache: [num_blocks, Hkv, block_size, D] (HND pages), dtype of k, a 16-bit dtype
    under float32 k, or float8_e4m3fn; slot_mapping: [T] int, slot = block * block_size +
    offset, -1 = do not write this token.

    Rotate-half: with x = [x1, x2] split at D/2 and (cos, sin) = cos_sin[position],
    x' = [x1 cos - x2 sin, x2 cos + x1 sin], computed in fp32, rounded once into q and k. A cache
    of k's dtype receives the rotated k as stored in k; a 16-bit cache under float32 k receives
    k and v rounded to it (to nearest even, as torch casts). An fp8 (E4M3) cache receives
    `quantize_e4m3(x', k_scale)` of the fp32 rotation (before its rounding to k's dtype) and
    `quantize_e4m3(v, v_scale)`: the stored values are k / k_scale and v / v_scale (the cache's
    per-layer scales, KVCache.scales; default 1), which attention dequantizes (paged_attention's
    k_scale / v_scale).
    """
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale and v_scale apply to an fp8 (float8_e4m3fn) cache only")
    half = q.shape[-1] // 2
    table = cos_sin[positions.long()]
    cos, sin = table[:, None, :half], table[:, None, half:]
    q.copy_(_rotate_fp32(q, cos, sin).to(q.dtype))
    k_rotated = _rotate_fp32(k, cos, sin)
    k.copy_(k_rotated.to(k.dtype))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices around a slice: the indexed result is [n, Hkv, D].
    if fp8:
        k_cache[blocks, :, offsets] = quantize_e4m3(
            k_rotated[keep], 1.0 if k_scale is None else k_scale
        )
        v_cache[blocks, :, offsets] = quantize_e4m3(v[keep], 1.0 if v_scale is None else v_scale)
    else:
        k_cache[blocks, :, offsets] = k[keep].to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v[keep].to(v_cache.dtype)
