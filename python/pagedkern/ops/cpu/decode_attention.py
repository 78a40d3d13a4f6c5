"""The CPU backend's decode attention planned once per step and run by every layer, over a
float32 copy of the decode rows' K/V that outlives the step.

Under the one-shot op (attention.paged_attention) every layer of every step gathers its
sequences' pages into float32 again: at decode that copy, not the math, is most of the cost.
Here a step's plan (DecodeRows, one per block table the step's layers read) holds, per layer,
the copy [2, Hkv, G, P, D] (G decode rows, P their longest length in whole blocks; slots past a
length zeroed), kept to the next step (DecodeCopies, owned by the model). The next step reuses
it when every row is the same sequence one token on (lengths + 1, the same padded width, the
same block ids wherever the last lengths reached: 15 of 16 steps of a steady batch, staggered
lengths too): its run then appends the layer's new k/v (as the cache stores them) instead of
gathering. Otherwise the first run of each layer gathers afresh (after rope_and_cache wrote this
step's k/v, so the copy is what a gather reads).

A run is then a few ops: q copied (scaled) into zero-padded GEMM rows, attention.tiled_attention
over the copy (one tile while the keys fit in one: bmm, mask, softmax, bmm), the output copied
back. It computes attention.paged_attention's function bit for bit (the same tiles of keys, the
same scale folding, the keys padded to whole blocks, at least MIN_GEMM_ROWS rows a GEMM), so a
decode row's result does not depend on whether its step planned (the model's steps) or called
the op (shadow mode, attention_plan:off), nor on the other rows of its batch: the engine's
greedy outputs stay independent of batch make-up (tests/test_cpu_decode.py).

Declined (the one-shot op runs instead, for every step alike): sliding windows and sinks (the
reference computes windowed calls), rows of length 0 or not written (slot -1).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ...reference.attention import MIN_GEMM_ROWS
from .attention import key_tile, tiled_attention


class _Copies(NamedTuple):
    """One block table's copies and what they were gathered for."""

    used: torch.Tensor  # [G, blocks] bool: the blocks its rows' lengths reach
    pages: torch.Tensor  # [G, blocks] the block ids read there (0 elsewhere)
    lengths: list[int]
    layers: dict  # (k_cache ptr, v_cache ptr) -> (k_cache, v_cache, kv [2, Hkv, G, P, D])


class DecodeCopies:
    """The decode rows' gathered K/V of the last step, per block table (by the order in which
    the step's layers first read them), for the next step to reuse (a model owns one)."""

    def __init__(self) -> None:
        self._last: dict[int, _Copies] = {}
        self._now: dict[int, _Copies] = {}

    def begin_step(self) -> None:
        """A new step: the last one's copies become reusable, once each; copies not claimed by
        this step are dropped at the next one."""
        self._last, self._now = self._now, {}

    def clear(self) -> None:
        """Give the copies' memory back."""
        self._last, self._now = {}, {}

    def claim(self, ordinal: int, used, pages, lengths: list[int], keep: bool) -> tuple[dict, bool]:
        """(layers dict, reused): the last step's copies of table `ordinal` when its rows are the
        same sequences one token on (then reused: runs append), else a new empty dict. keep:
        the dict is offered to the next step (one sequence per row)."""
        last = self._last.pop(ordinal, None)
        reused = (
            last is not None
            and last.used.shape == used.shape
            and all(n == m + 1 for n, m in zip(lengths, last.lengths, strict=True))
            and torch.equal(pages.masked_fill(~last.used, 0), last.pages)
        )
        layers = last.layers if reused else {}
        del last  # (dropped before any new gather: never two copies alive)
        if keep:
            self._now[ordinal] = _Copies(used, pages, lengths, layers)
        return layers, reused


class DecodeRows:
    """A step's decode rows over one block table: what every layer's run shares."""

    def __init__(
        self,
        copies: DecodeCopies,
        ordinal: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
    ) -> None:
        lengths = seq_lens.tolist()
        self.lengths = lengths
        self.rows = len(lengths)
        self.block_size = block_size
        nblk = -(-max(lengths) // block_size)
        self.padded = nblk * block_size
        tables = block_tables[:, :nblk].long()
        starts = torch.arange(0, self.padded, block_size)
        lens = torch.tensor(lengths)
        used = starts[None, :] < lens[:, None]
        self.pages = tables.masked_fill(~used, 0)
        past = torch.arange(self.padded)[None, :] >= lens[:, None]  # [G, P]
        self.past = past.view(-1).nonzero().squeeze(1) if bool(past.any()) else None
        self.bias = None
        if self.past is not None:  # the softmax mask, batch index kv head * G + row
            self.bias = torch.zeros(past.shape).masked_fill_(past, float("-inf"))[:, None, :]
        new_slot = positions.long() == lens - 1
        keep = bool(new_slot.all()) and _distinct(tables)
        self.layers, self.reused = copies.claim(ordinal, used, self.pages, lengths, keep)
        self.reused = self.reused and keep
        self.dst = torch.arange(self.rows) * self.padded + (lens - 1)  # the new token's slot
        self.tile = key_tile(block_size)
        self.nearest = min(lengths)  # keys below it: visible to every row
        self._buffers: dict[tuple, tuple] = {}

    def operands(self, k_cache, v_cache, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (keys [Hkv * G, D, P], values [Hkv * G, P, D]) over its copy: the last
        step's plus this step's k/v where reused, else gathered."""
        key = (k_cache.data_ptr(), v_cache.data_ptr())
        entry = self.layers.get(key)
        if entry is not None and self.reused and entry[0] is k_cache and entry[1] is v_cache:
            self._append(entry[2], k_cache, v_cache, k, v)
            return entry[3]
        kv = self._gather(k_cache, v_cache)
        hkv, d = kv.shape[1], kv.shape[-1]
        views = (
            kv[0].view(hkv * self.rows, self.padded, d).transpose(1, 2),
            kv[1].view(hkv * self.rows, self.padded, d),
        )
        self.layers[key] = (k_cache, v_cache, kv, views)
        return views

    def _gather(self, k_cache, v_cache) -> torch.Tensor:
        hkv, bs, d = k_cache.shape[1:]
        g, nblk = self.pages.shape
        kv = torch.empty(2, hkv, g * nblk, bs, d)
        flat = self.pages.view(-1)
        for i, cache in enumerate((k_cache, v_cache)):
            # whole pages by index_select over the cache's leading (block) dim, then into the
            # copy's [Hkv, G * blocks, bs, D] order (over another dim of the strided cache
            # view torch copies the whole cache first: ~25 ms a layer at a 1 GiB cache)
            pages = cache.index_select(0, flat).view(g * nblk, hkv, bs, d)
            kv[i].copy_(pages.transpose(0, 1))
        kv = kv.view(2, hkv, g, self.padded, d)
        if self.past is not None:  # never-written slots may hold NaN; masked scores still
            kv.view(2, hkv, -1, d).index_fill_(2, self.past, 0.0)  # multiply the values
        return kv

    def _append(self, kv, k_cache, v_cache, k, v) -> None:
        """The rows' new k/v (what the cache now holds at each row's last slot) into the copy."""
        hkv, d = kv.shape[1], kv.shape[-1]
        rows = kv.view(2, hkv, -1, d)
        if k is not None and k.dtype == k_cache.dtype and k.dtype == torch.float32:
            pair = _pair_rows(k, v)
            if pair is not None:  # k and v heads adjacent (a fused QKV output): one copy
                rows.index_copy_(2, self.dst, pair)
                return
            rows[0].index_copy_(1, self.dst, k.transpose(0, 1))
            rows[1].index_copy_(1, self.dst, v.transpose(0, 1))
            return
        last = torch.tensor(self.lengths) - 1  # each row's new token (a cache of another dtype)
        blocks = self.pages.gather(1, (last // self.block_size)[:, None]).squeeze(1)
        offsets = last % self.block_size
        for i, cache in enumerate((k_cache, v_cache)):
            rows[i].index_copy_(1, self.dst, cache[blocks, :, offsets].float().transpose(0, 1))

    def buffers(self, hkv: int, group: int, d: int):
        """(q_padded [Hkv, G, rows, D] zeros, its real rows' view, the mask), made once a step:
        the pad rows stay zero, each run writes the real ones."""
        key = (hkv, group, d)
        found = self._buffers.get(key)
        if found is None:
            q_padded = torch.zeros(hkv, self.rows, max(group, MIN_GEMM_ROWS), d)
            bias, rows = self.bias, self.rows
            hide = None
            if bias is not None:

                def hide(scores: torch.Tensor, c0: int, c1: int) -> None:  # -inf past lengths
                    scores.view(hkv, rows, -1, c1 - c0).add_(bias[..., c0:c1])

            flat = q_padded.view(hkv * self.rows, -1, d)
            found = self._buffers[key] = (flat, q_padded[:, :, :group], hide)
        return found


def _pair_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """[2, Hkv, T, D] over k and v [T, Hkv, D] where v's heads follow k's (one QKV output)."""
    t, hkv, d = k.shape
    if k.stride()[1:] != (d, 1) or v.stride()[1:] != (d, 1):
        return None
    if t > 1 and k.stride(0) != v.stride(0):
        return None
    if v.data_ptr() - k.data_ptr() != hkv * d * k.element_size():
        return None
    return k.as_strided((2, hkv, t, d), (hkv * d, d, k.stride(0), 1))


def _distinct(tables: torch.Tensor) -> bool:
    """Whether every row is its own sequence (distinct block tables: different sequences differ
    in the block of their current position). Equal tables have equal weighted sums, so distinct
    sums prove it (a 1-D unique: ~20x cheaper than unique(dim=0)'s row sort at 256 rows); a tie
    is rechecked. Random 64-bit weights (the sum wraps): with weights 1, 2, 3, ... the engine's
    tables of consecutive block ids tied in 22 of 30 steps at 256 rows."""
    rows = tables.shape[0]
    if rows < 2:
        return True
    sums = (tables * _table_weights(tables.shape[1])).sum(1)
    if sums.unique().numel() == rows:
        return True
    return torch.unique(tables, dim=0).shape[0] == rows


@functools.cache
def _table_weights(width: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(width)
    return torch.randint(-(2**62), 2**62, (width,), dtype=torch.int64, generator=generator)


class CpuDecodeAttention:
    """One kind of layer's decode attention over a step's DecodeRows (scale, soft-cap, fp8
    scales); run(q, k_cache, v_cache, out, k, v) per layer."""

    def __init__(
        self,
        rows: DecodeRows,
        scale: float | None,
        soft_cap: float | None,
        k_scale: float | None,
        v_scale: float | None,
    ) -> None:
        self.rows = rows
        self.soft_cap = soft_cap
        self.v_scale = None if v_scale == 1.0 else v_scale
        self._scale = scale
        self._k_scale = 1.0 if k_scale is None else k_scale
        self._scales_of: dict[int, tuple] = {}  # head dim -> _scales
        self.workspace = None  # (StepAttention shares split-KV workspaces: none here)

    @staticmethod
    def declines(sliding_window, sinks, seq_lens: torch.Tensor, slot_mapping) -> bool:
        """Whether the one-shot op must run these rows (see the module's doc)."""
        if sliding_window is not None or sinks is not None or seq_lens.numel() == 0:
            return True
        return int(seq_lens.min()) < 1 or int(slot_mapping.min()) < 0

    def _scales(self, d: int) -> tuple[float | None, float | None]:
        """(the scale folded into q, the scale of the scores): a power of two (D = 64, 256)
        commutes with every rounding, so it rides on q as the op folds it."""
        found = self._scales_of.get(d)
        if found is None:
            scale = (d**-0.5 if self._scale is None else self._scale) * self._k_scale
            folds = self.soft_cap is None and math.frexp(scale)[0] == 0.5
            found = self._scales_of[d] = (scale, None) if folds else (None, scale)
        return found

    def run(self, q, k_cache, v_cache, out, k=None, v=None):
        """Attention of one layer's decode rows q [G, Hq, D] into out [G, Hq, D]; k, v: this
        layer's new k/v rows (as rope_and_cache stored them), or None (read from the cache)."""
        r = self.rows
        g_rows, hq, d = q.shape
        hkv = k_cache.shape[1]
        group = hq // hkv
        keys, values = r.operands(k_cache, v_cache, k, v)
        q_flat, q_real, hide = r.buffers(hkv, group, d)
        folded, scale = self._scales(d)
        q_heads = q.view(g_rows, hkv, group, d).transpose(0, 1)
        if folded is None:
            q_real.copy_(q_heads)
        elif q.dtype == torch.float32:
            torch.mul(q_heads, folded, out=q_real)
        else:
            q_real.copy_(q_heads).mul_(folded)
        o, _ = tiled_attention(
            q_flat, keys, values, scale, hide, r.padded, r.tile, self.soft_cap,
            open_until=r.nearest, alive_until=1,
        )  # fmt: skip
        o = o.view(hkv, g_rows, -1, d)[:, :, :group]
        if self.v_scale is not None:
            o = o * self.v_scale
        out.view(g_rows, hkv, group, d).copy_(o.transpose(0, 1))
        return out
