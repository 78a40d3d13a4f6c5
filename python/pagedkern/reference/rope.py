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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q and k in place and write k and v into their cache pages.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (views into a fused QKV output are fine);
    positions: [T] int; cos_sin: [max_positions, D] float32 from `cos_sin_cache`;
    k_cache, v_cache: [num_blocks, Hkv, block_size, D] (HND pages), dtype of k or
    float8_e4m3fn (written saturated; the attention references read any dtype as fp32);
    slot_mapping: [T] int, slot = block * block_size + offset, -1 = do not write this token.

    Rotate-half: with x = [x1, x2] split at D/2 and (cos, sin) = cos_sin[position],
    x' = [x1 cos - x2 sin, x2 cos + x1 sin], computed in fp32, rounded once. The cache receives
    the rotated k.
    """
    half = q.shape[-1] // 2
    table = cos_sin[positions.long()]
    cos, sin = table[:, None, :half], table[:, None, half:]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices around a slice: the indexed result is [n, Hkv, D].
    k_cache[blocks, :, offsets] = _to_cache(k[keep], k_cache.dtype)
    v_cache[blocks, :, offsets] = _to_cache(v[keep], v_cache.dtype)


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache dtype; an fp8 (E4M3) cache saturates at +-448 (a plain cast would give NaN). The
    caller divides k/v by the cache's per-layer scales beforehand (KVCache.scales)."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-448.0, 448.0).to(dtype)
    return x
