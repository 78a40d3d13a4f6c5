"""The CPU backend's rope_and_cache: reference.rope_and_cache's function in fewer torch ops.

The reference rotates q and k apart (split, four products, two differences, a cat, a copy back:
~10 ops each) and writes k and v with two advanced-index stores. Here, once per step
(begin_step; every layer after a step's first reuses them): the RoPE rows, as
x' = x * [cos, cos] + roll(x, D/2) * [-sin, sin] (roll(x) = [x2, x1]; the same products and
sums as the reference, negation exact: the same bits, no FMA), and the cache slots. Per layer:
q and k rotated together where they are adjacent heads of one fused QKV output, in fp32 by
three ops into a step buffer ([x, roll(x)] by one index_select of x's halves, times [cos2,
sin2], the halves added into x; many rows: roll, two multiplies, an add); k and v stored by one
index_copy_ where the caches are the two halves of one layer's [2, blocks, Hkv, bs, D] (the
model's KVCache), through a view whose rows are the slots (row b * Hkv * bs + offset: the
view's rows overlap, each slot's heads sit a block row apart).

fp32 rows over an fp32, bf16, fp16 or fp8 cache (the CPU default, and --kv-cache-dtype
bfloat16, float16, fp8) take one C++ call a layer instead (csrc/cpu/rope_cache.cpp): the same
products and sums, the 16-bit casts' rounding, and the fp8 write's product, clamp and rounding,
so the same bits (QK-norm there too, in csrc/cpu/rms.h's fixed order: not torch.rms_norm's
bits, ~1e-7 apart); the torch ops above run the rest (half-precision rows) and wherever
pagedkern._cpu is not built.
"""

from __future__ import annotations

import weakref

import torch

from ...reference.rope import quantize_e4m3
from . import quant_gemv
from .attention_kernel import CACHE_DTYPES, dense_fp32_heads
from .layer_tail import address, fp32_vector
from .norm import rms_norm


class _StepRows:
    """What every layer of a step shares: the RoPE rows, the cache slots, rotation buffers."""

    __slots__ = (
        "cos_sin", "positions", "slot_mapping", "block_size", "factors", "keep", "_slots",
        "_rows_of", "_buffers",
    )  # fmt: skip

    def __init__(self, cos_sin, positions, slot_mapping, block_size: int) -> None:
        self.cos_sin, self.positions, self.slot_mapping = cos_sin, positions, slot_mapping
        self.block_size = block_size
        self.factors = factors_table(cos_sin).index_select(0, positions)[:, None]  # [T, 1, 2D]
        self.keep = None  # [T] bool rows written (None: all)
        if slot_mapping.shape[0] <= _FEW:  # a few: on the host (one op, not a few)
            self._slots = slot_mapping.tolist()
            if min(self._slots, default=0) < 0:
                self.keep = slot_mapping >= 0
                self._slots = [s for s in self._slots if s >= 0]
        else:
            self._slots = slot_mapping.long()
            if self._slots.numel() and int(self._slots.min()) < 0:
                self.keep = self._slots >= 0
                self._slots = self._slots[self.keep]
        self._rows_of: dict[int, torch.Tensor] = {}
        self._buffers: dict[tuple, tuple] = {}

    def blocks_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([n] blocks, [n] offsets) of the written rows' slots."""
        slots = torch.as_tensor(self._slots, dtype=torch.long)
        return slots // self.block_size, slots % self.block_size

    def cache_rows(self, hkv: int) -> torch.Tensor:
        """[n] the slots' rows of a _slot_rows view of a cache with hkv heads."""
        rows = self._rows_of.get(hkv)
        if rows is None:  # slot b * bs + o -> row b * Hkv * bs + o
            skip, bs = (hkv - 1) * self.block_size, self.block_size
            if isinstance(self._slots, list):
                rows = torch.tensor([s + s // bs * skip for s in self._slots], dtype=torch.long)
            else:
                rows = self._slots + self._slots // bs * skip
            self._rows_of[hkv] = rows
        return rows

    def rotate(self, x: torch.Tensor) -> None:
        """fp32 x [T, H, D] rotated in place (see the module doc)."""
        t, h, d = x.shape
        if t > _FEW_ROTATE:  # (index_select's copies get slower per row than roll's)
            cos2, sin2 = self.factors.chunk(2, dim=-1)
            rolled = x.roll(d // 2, dims=-1).mul_(sin2)
            x.mul_(cos2).add_(rolled)
            return
        found = self._buffers.get((h, d))
        if found is None:
            both = torch.empty(t, h, 2 * d)
            quarters = both.view(t, h, 4, d // 2)
            found = self._buffers[(h, d)] = (both, both[..., :d], both[..., d:], quarters)
        both, products, rolled, quarters = found
        torch.index_select(x.view(t, h, 2, d // 2), 2, _HALVES, out=quarters)  # [x, roll(x)]
        both.mul_(self.factors)  # (not addcmul: its FMA rounds apart)
        torch.add(products, rolled, out=x)


_HALVES = torch.tensor([0, 1, 1, 0])  # [x1, x2] -> [x1, x2, x2, x1]: x, then roll(x, D/2)
_FEW_ROTATE = 16  # rows rotated by the index_select up to (past it: roll, 4 ops)
_FEW = 32  # rows a step's slots are handled on the host up to


# cos_sin tables' [cos, cos, -sin, sin] rows: (cos_sin ref, its version, the rows), by id
_tables: dict[int, tuple] = {}


def factors_table(cos_sin: torch.Tensor) -> torch.Tensor:
    """[positions, 2D] rows [cos, cos, -sin, sin] of cos_sin [positions, D] (cos | sin), made
    once per table (and again after an in-place change)."""
    found = _tables.get(id(cos_sin))
    if found is not None and found[0]() is cos_sin and found[1] == cos_sin._version:
        return found[2]
    cos, sin = cos_sin.chunk(2, dim=1)
    factors = torch.cat([cos, cos, -sin, sin], dim=1)
    if len(_tables) >= 8:  # (tables of models since freed)
        _tables.clear()
    _tables[id(cos_sin)] = (weakref.ref(cos_sin), cos_sin._version, factors)
    return factors


# The current step's rows by (positions, slot_mapping) identity (a hybrid cache's groups have
# slot mappings of their own). Valid for one step only: begin_step() starts the next, which
# the model's CPU-backend step calls, and every call through ops.rope_and_cache (a caller may
# refill its tensors in place between calls).
_step: dict[tuple[int, int], _StepRows] = {}


def begin_step() -> None:
    """A new step (new positions and slots, possibly in the same tensors): forget the rows."""
    _step.clear()
    _step_indices.clear()


def _rows(positions, cos_sin, slot_mapping, block_size: int) -> _StepRows:
    """The step's RoPE rows and slots: made by its first layer, the same for the others."""
    key = (id(positions), id(slot_mapping))
    rows = _step.get(key)
    if (
        rows is None
        or rows.positions is not positions
        or rows.slot_mapping is not slot_mapping
        or rows.cos_sin is not cos_sin
        or rows.block_size != block_size
    ):
        rows = _step[key] = _StepRows(cos_sin, positions, slot_mapping, block_size)
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


def _rotate(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] of half precision rotated in place (fp32 math, rounded once); returns the
    fp32 rotation."""
    cos2, sin2 = factors.chunk(2, dim=-1)
    xf = x.float()
    rolled = xf.roll(x.shape[-1] // 2, dims=-1).mul_(sin2)  # not addcmul: its FMA rounds apart
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
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale and v_scale apply to an fp8 (float8_e4m3fn) cache only")
    if q.shape[0] and _in_cpp(q, k, v, k_cache, v_cache, q_norm, k_norm):
        options = {} if q_norm is None else dict(q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps)
        if fp8:
            options.update(k_inv_scale=inverse(k_scale), v_inv_scale=inverse(v_scale))
        _rope_cache_cpp(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, **options)
        return
    if q_norm is not None:  # in place, as the kernel: the heads normalised, then rotated
        q.copy_(rms_norm(q, q_norm, norm_eps))
        k.copy_(rms_norm(k, k_norm, norm_eps))
    if q.shape[0] == 0:
        return
    rows = _rows(positions, cos_sin, slot_mapping, k_cache.shape[2])
    fused = _fused(q, k, v)  # q, k and v heads of one QKV output
    qk = None
    if fused or _adjacent(q, k):  # q and k rotated as one tensor
        qk = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
    if q.dtype == torch.float32:
        for x in (q, k) if qk is None else (qk,):
            rows.rotate(x)
        k_rotated = k
    elif qk is not None:
        k_rotated = _rotate(qk, rows.factors)[:, q.shape[1] :]
    else:
        _rotate(q, rows.factors)
        k_rotated = _rotate(k, rows.factors)
    narrow = not fp8 and k_cache.dtype != k.dtype  # a 16-bit cache under fp32 rows
    if fp8:
        k_new = quantize_e4m3(k_rotated, 1.0 if k_scale is None else k_scale)
        v_new = quantize_e4m3(v, 1.0 if v_scale is None else v_scale)
    elif narrow:
        k_new, v_new = k.to(k_cache.dtype), v.to(k_cache.dtype)
    else:
        k_new, v_new = k, v
    if rows.keep is not None:
        k_new, v_new = k_new[rows.keep], v_new[rows.keep]
    elif not fp8:
        dense, step = _cache_layout(k_cache, v_cache)
        if dense:
            slot_rows = rows.cache_rows(k_cache.shape[1])
            if step is not None and not narrow and (fused or _adjacent(k, v)):  # one store
                kv = k.as_strided((2, *k.shape), (k.shape[1] * k.shape[2], *k.stride()))
                _slot_rows(k_cache, step).index_copy_(1, slot_rows, kv)
                return
            _slot_rows(k_cache).index_copy_(0, slot_rows, k_new)
            _slot_rows(v_cache).index_copy_(0, slot_rows, v_new)
            return
    blocks, offsets = rows.blocks_offsets()
    k_cache[blocks, :, offsets] = k_new
    v_cache[blocks, :, offsets] = v_new


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q, k and v [T, H, D] are [q | k | v] heads of one strided tensor (_adjacent of
    q and k, and of k and v, in fewer calls)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    size = q.element_size()
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    return (
        k.data_ptr() == q.data_ptr() + hq * d * size
        and v.data_ptr() == k.data_ptr() + hkv * d * size
        and q.dtype == k.dtype == v.dtype
        and k.shape == v.shape == (t, hkv, d)
        and qs[1:] == ks[1:] == vs[1:] == (d, 1)
        and (t == 1 or qs[0] == ks[0] == vs[0])
    )


# (k_cache ptr, v_cache ptr) -> (k_cache ref, v_cache ref, _cache_layout): the model's caches
# are the same tensors every step (weak references: an entry never keeps a cache alive)
_layouts: dict[tuple[int, int], tuple] = {}


def _cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[bool, int | None]:
    """(both caches dense (_whole), _pair_step), remembered per pair of cache tensors."""
    key = (k_cache.data_ptr(), v_cache.data_ptr())
    found = _layouts.get(key)
    if found is not None and found[0]() is k_cache and found[1]() is v_cache:
        return found[2]
    layout = (_whole(k_cache) and _whole(v_cache), _pair_step(k_cache, v_cache))
    if len(_layouts) > 4096:  # (entries of caches since freed)
        _layouts.clear()
    _layouts[key] = (weakref.ref(k_cache), weakref.ref(v_cache), layout)
    return layout


def _whole(cache: torch.Tensor) -> bool:
    """Whether cache [blocks, Hkv, bs, D] is laid out densely (strides of a contiguous one)."""
    _, hkv, bs, d = cache.shape
    return cache.stride() == (hkv * bs * d, bs * d, d, 1)


def _slot_rows(cache: torch.Tensor, pair_step: int | None = None) -> torch.Tensor:
    """[rows, Hkv, D] over a dense cache [blocks, Hkv, bs, D]: row b * Hkv * bs + offset is
    slot (b, offset); the rows overlap (written by index only). pair_step: [2, rows, Hkv, D]
    over it and the cache that many elements on (_pair_step)."""
    blocks, hkv, bs, d = cache.shape
    rows = (blocks - 1) * hkv * bs + bs  # the last block's last slot is the last row
    if pair_step is None:
        return cache.as_strided((rows, hkv, d), (d, bs * d, 1))
    return cache.as_strided((2, rows, hkv, d), (pair_step, d, bs * d, 1))


def _pair_step(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
    """The elements from k_cache to v_cache where v_cache follows k_cache by one cache's extent
    or more with the same strides (a KVCache layer's halves), else None."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        return None
    base = k_cache._base  # views of one tensor: one allocation; else compare storages
    if (base is None or base is not v_cache._base) and (
        k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr()
    ):
        return None  # two allocations: their distance is no stride of either
    step, size = v_cache.data_ptr() - k_cache.data_ptr(), k_cache.element_size()
    if step < k_cache.shape[0] * k_cache.stride(0) * size or step % size:
        return None
    return step // size


def _in_cpp(q, k, v, k_cache, v_cache, q_norm=None, k_norm=None) -> bool:
    """Whether csrc/cpu/rope_cache.cpp runs this call: fp32 rows (heads dense) and a cache of a
    dtype the module writes (fp32, bf16, fp16, fp8 E4M3), one layout for k and v, QK-norm
    weights (if any) fp32 [D], the module built."""
    return (
        fp32_vector(q_norm, q.shape[2])
        and fp32_vector(k_norm, q.shape[2])
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in CACHE_DTYPES
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and q.shape[2] <= 512
        and all(map(dense_fp32_heads, (q, k, v)))
        and quant_gemv.available()
    )


# The step's int64 positions and slots for the C++ call, by (positions, slot_mapping) identity
# (begin_step forgets them, as the rows above)
_step_indices: dict[tuple[int, int], tuple] = {}


def inverse(scale: float | None) -> float:
    """1 / scale as the fp8 write multiplies by it (the module rounds it to fp32: the
    reference's fp32(1 / scale)); 1 for None."""
    return 1.0 if scale is None else 1.0 / scale


def _rope_cache_cpp(
    q,
    k,
    v,
    positions,
    cos_sin,
    k_cache,
    v_cache,
    slot_mapping,
    q_norm=None,
    k_norm=None,
    norm_eps: float = 1e-6,
    **fp8,
) -> None:
    """fp8: k_inv_scale and v_inv_scale (inverse()) for an E4M3 cache."""
    key = (id(positions), id(slot_mapping))
    found = _step_indices.get(key)
    if found is None or found[0] is not positions or found[1] is not slot_mapping:
        indices = (positions.long().contiguous(), slot_mapping.long().contiguous())
        found = _step_indices[key] = (positions, slot_mapping, *indices)
    _, _, pos, slots = found
    factors = factors_table(cos_sin)
    quant_gemv.cpu_module().rope_cache(
        q=q.data_ptr(), q_row_stride=q.stride(0), k=k.data_ptr(), k_row_stride=k.stride(0),
        v=v.data_ptr(), v_row_stride=v.stride(0), rows=q.shape[0], hq=q.shape[1],
        hkv=k.shape[1], d=q.shape[2], factors=factors.data_ptr(),
        num_positions=factors.shape[0], positions=pos.data_ptr(), slots=slots.data_ptr(),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        block_stride=k_cache.stride(0), head_stride=k_cache.stride(1),
        slot_stride=k_cache.stride(2), num_blocks=k_cache.shape[0], block_size=k_cache.shape[2],
        threads=torch.get_num_threads(), q_norm=address(q_norm), k_norm=address(k_norm),
        norm_eps=float(norm_eps), cache_dtype=CACHE_DTYPES[k_cache.dtype], **fp8,
    )  # fmt: skip
