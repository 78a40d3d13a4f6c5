"""The CPU backend's rope_and_cache: reference.rope_and_cache's function in fewer torch ops.

The reference rotates q and k apart (split, four products, two differences, a cat, a copy back:
~10 ops each) and writes k and v with two advanced-index stores. Here, once per step
(begin_step; every layer after a step's first reuses them): the RoPE rows, as
x' = x * [cos, cos] + roll(x, D/2) * [-sin, sin] (roll(x) = [x2, x1]; the same products and
sums as the reference, negation exact: the same bits, no FMA), and the cache slots. Per layer:
q and k rotated together where they are adjacent heads of one fused QKV output (roll, two
multiplies, an add), and k and v stored by one index_put where the caches are the two halves
of one layer's [2, blocks, Hkv, bs, D] (the model's KVCache).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...reference.rope import quantize_e4m3
from .norm import rms_norm


class _StepRows(NamedTuple):
    """What every layer of a step shares: the RoPE rows and the cache slots."""

    cos_sin: torch.Tensor  # made from (by identity)
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    cos2: torch.Tensor  # [T, 1, D] [cos, cos]
    sin2: torch.Tensor  # [T, 1, D] [-sin, sin]
    keep: torch.Tensor | None  # [T] bool rows written (None: all)
    blocks: torch.Tensor  # [n] long
    offsets: torch.Tensor  # [n] long


# The current step's rows by (positions, slot_mapping) identity (a hybrid cache's groups have
# slot mappings of their own). Valid for one step only: begin_step() starts the next, which
# the model's CPU-backend step calls, and every call through ops.rope_and_cache (a caller may
# refill its tensors in place between calls).
_step: dict[tuple[int, int], _StepRows] = {}


def begin_step() -> None:
    """A new step (new positions and slots, possibly in the same tensors): forget the rows."""
    _step.clear()


def _rows(positions, cos_sin, slot_mapping, block_size: int) -> _StepRows:
    """The step's RoPE rows and slots: made by its first layer, the same for the others."""
    key = (id(positions), id(slot_mapping))
    rows = _step.get(key)
    if (
        rows is not None
        and rows.positions is positions
        and rows.slot_mapping is slot_mapping
        and rows.cos_sin is cos_sin
        and rows.block_size == block_size
    ):
        return rows
    half = cos_sin.shape[1] // 2
    table = cos_sin[positions.long()]
    cos, sin = table[:, None, :half], table[:, None, half:]
    slots = slot_mapping.long()
    keep = None
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots = slots[keep]
    rows = _step[key] = _StepRows(
        cos_sin, positions, slot_mapping, block_size, torch.cat([cos, cos], dim=-1),
        torch.cat([-sin, sin], dim=-1), keep, slots // block_size, slots % block_size,
    )  # fmt: skip
    return rows


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """[T, H, D] a and b where b's heads follow a's (contiguous heads, the same row stride):
    [a | b] is one strided tensor."""
    return (
        a.dtype == b.dtype
        and a.shape[0] == b.shape[0]
        and a.shape[2:] == b.shape[2:]
        and a.stride()[1:] == b.stride()[1:] == (a.shape[2], 1)
        and (a.shape[0] == 1 or a.stride(0) == b.stride(0))
        and b.data_ptr() == a.data_ptr() + a.shape[1] * a.shape[2] * a.element_size()
    )


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in place (fp32 math, rounded once for half precision); returns the
    fp32 rotation (x itself for fp32)."""
    xf = x.float()
    rolled = xf.roll(x.shape[-1] // 2, dims=-1).mul_(sin2)  # not addcmul: its FMA rounds apart
    if xf is x:
        return x.mul_(cos2).add_(rolled)
    rotated = xf.mul_(cos2).add_(rolled)
    x.copy_(rotated)
    return rotated


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
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> None:
    """ops.rope_and_cache's function (arguments validated by it, or the model's own tensors):
    QK-norm if given, RoPE of q and k in place, k and v into the cache (fp8: E4M3 of k / k_scale
    and v / v_scale, the rotation quantized before its rounding to k's dtype)."""
    if q_norm is not None:  # in place, as the kernel: the heads normalised, then rotated
        q.copy_(rms_norm(q, q_norm, norm_eps))
        k.copy_(rms_norm(k, k_norm, norm_eps))
    if q.shape[0] == 0:
        return
    rows = _rows(positions, cos_sin, slot_mapping, k_cache.shape[2])
    if _adjacent(q, k):
        qk = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
        k_rotated = _rotate(qk, rows.cos2, rows.sin2)[:, q.shape[1] :]
    else:
        _rotate(q, rows.cos2, rows.sin2)
        k_rotated = _rotate(k, rows.cos2, rows.sin2)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale and v_scale apply to an fp8 (float8_e4m3fn) cache only")
    if fp8:
        k_new = quantize_e4m3(k_rotated, 1.0 if k_scale is None else k_scale)
        v_new = quantize_e4m3(v, 1.0 if v_scale is None else v_scale)
    else:
        k_new, v_new = k, v
    if rows.keep is not None:
        k_new, v_new = k_new[rows.keep], v_new[rows.keep]
    blocks, offsets = rows.blocks, rows.offsets
    pair = None if fp8 or rows.keep is not None else _pair_cache(k_cache, v_cache)
    if pair is not None and _adjacent(k, v):  # one store: [n, 2, Hkv, D] into both caches
        heads = k.shape[1] * k.stride(1)  # v follows k by its heads (_adjacent)
        kv = k.as_strided((k.shape[0], 2, *k.shape[1:]), (k.stride(0), heads, *k.stride()[1:]))
        pair[:, blocks, :, offsets] = kv
        return
    k_cache[blocks, :, offsets] = k_new
    v_cache[blocks, :, offsets] = v_new


def _pair_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """[2, blocks, Hkv, bs, D] over both caches where v_cache follows k_cache by one cache's
    extent with the same strides (a KVCache layer's halves), else None."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        return None
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return None  # two allocations: their distance is no stride of either
    step = v_cache.data_ptr() - k_cache.data_ptr()
    if step <= 0 or step % k_cache.element_size():
        return None
    return k_cache.as_strided(
        (2, *k_cache.shape), (step // k_cache.element_size(), *k_cache.stride())
    )
