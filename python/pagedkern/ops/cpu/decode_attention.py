"""The CPU backend's decode attention planned once per step and run by every layer, over a
float32 copy of the decode rows' K/V that outlives the step.

Under the one-shot op (attention.paged_attention) every layer of every step gathers its
sequences' pages into float32 again: at decode that copy, not the math, is most of the cost.
Here a step's plan (DecodeRows, one per block table the step's layers read) holds, per layer,
the copy [2, Hkv, G, P, D] (G decode rows, P their longest length in whole key tiles; slots
past a length zeroed), kept to the next step (DecodeCopies, owned by the model). The next step
reuses it when every row is the same sequence one token on (lengths + 1, the same padded width,
the same block ids wherever the last lengths reached: 255 of 256 steps of a steady batch,
staggered lengths too): its run then appends the layer's new k/v (as the cache stores them)
instead of gathering. Otherwise the first run of each layer gathers afresh (after
rope_and_cache wrote this step's k/v, so the copy is what a gather reads).

A run is then a few ops: q copied (scaled) into zero-padded GEMM rows, attention.tiled_attention
over the copy (one tile while the keys fit in one: bmm, mask, softmax, bmm), the output copied
back. It computes attention.paged_attention's function bit for bit (the same tiles of keys, the
same scale folding, the keys padded to whole tiles, at least MIN_GEMM_ROWS rows a GEMM), so a
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

from ...reference.key_blocks import MIN_GEMM_ROWS
from .attention import key_tile, table_columns, tiled_attention, whole_tiles


class _Copies(NamedTuple):
    """One block table's copies and what they were gathered for."""

    width: int  # the blocks a row's copy holds
    blocks: tuple | None  # per row, the block ids its length reaches (host bookkeeping)
    used: torch.Tensor | None  # else: [G, width] bool, the blocks its rows' lengths reach,
    pages: torch.Tensor | None  # and [G, width] the block ids read there (0 elsewhere)
    lengths: list[int]
    layers: dict  # (k_cache ptr, v_cache ptr) -> _Layer


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

    def claim(self, ordinal: int, rows: DecodeRows, keep: bool) -> tuple[dict, bool]:
        """(layers dict, reused): the last step's copies of table `ordinal` when its rows are the
        same sequences one token on (then reused: runs append), else a new empty dict. keep:
        the dict is offered to the next step (one sequence per row)."""
        last = self._last.pop(ordinal, None)
        lengths = rows.lengths
        reused = (
            last is not None
            and last.width == rows.width
            and len(last.lengths) == len(lengths)
            and all(n == m + 1 for n, m in zip(lengths, last.lengths, strict=True))
            and _same_blocks(last, rows)
        )
        layers = last.layers if reused else {}
        del last  # (dropped before any new gather: never two copies alive)
        if keep:
            self._now[ordinal] = _Copies(
                rows.width, rows.blocks, rows.used, rows.tensor_pages, lengths, layers
            )
        return layers, reused


def _same_blocks(last: _Copies, rows: DecodeRows) -> bool:
    """Whether each row reads the blocks its last copy read where that one reached."""
    if last.blocks is not None and rows.blocks is not None:
        return all(b[: len(a)] == a for a, b in zip(last.blocks, rows.blocks, strict=True))
    if last.used is not None and rows.used is not None:
        return torch.equal(rows.tensor_pages.masked_fill(~last.used, 0), last.pages)
    return False  # (bookkept apart: gathered afresh)


# Rows x blocks up to which a step's bookkeeping runs on the host (a few tolist and tensor
# calls, not ~25 small torch ops); past it as tensors
HOST_ENTRIES = 1024


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
        self.rows = g = len(lengths)
        self.block_size = block_size
        self.tile = tile = key_tile(block_size)
        self.padded = padded = whole_tiles(max(lengths), tile)  # as the one-shot op pads
        self.width = nblk = padded // block_size
        self.blocks = self.used = self.tensor_pages = None
        if g * nblk <= HOST_ENTRIES:
            table_rows = block_tables[:, :nblk].tolist()
            self.blocks = tuple(
                tuple(row[: -(-n // block_size)]) for row, n in zip(table_rows, lengths)
            )
            keep = positions.tolist() == [n - 1 for n in lengths]
            keep = keep and len(set(map(tuple, table_rows))) == g  # distinct sequences
            self.dst = torch.tensor([i * padded + n - 1 for i, n in enumerate(lengths)])
        else:
            tables = table_columns(block_tables, nblk)
            starts = torch.arange(0, padded, block_size)
            lens = torch.tensor(lengths)
            self.used = starts[None, :] < lens[:, None]
            self.pages = self.tensor_pages = tables.masked_fill(~self.used, 0)
            new_slot = positions.long() == lens - 1
            keep = bool(new_slot.all()) and _distinct(tables)
            self.dst = torch.arange(g) * padded + (lens - 1)  # the new token's slot
        self.bias = None
        if any(n < padded for n in lengths):  # the softmax mask, batch index kv head * G + row
            past = self._past_mask[:, None]
            self.bias = torch.zeros(g, 1, padded).masked_fill_(past, float("-inf"))
        self.layers, self.reused = copies.claim(ordinal, self, keep)
        self.reused = self.reused and keep
        self.nearest = min(lengths)  # keys below it: visible to every row
        self._buffers: dict[tuple, _Buffers] = {}

    @functools.cached_property
    def pages(self) -> torch.Tensor:
        """[G, blocks] the block ids the rows' lengths reach (0 elsewhere)."""
        return torch.tensor([[*b, *[0] * (self.width - len(b))] for b in self.blocks])

    @functools.cached_property
    def _past_mask(self) -> torch.Tensor:
        """[G, P] bool: the slots past each row's length (the padding included)."""
        return torch.arange(self.padded)[None, :] >= torch.tensor(self.lengths)[:, None]

    @functools.cached_property
    def past(self) -> torch.Tensor | None:
        """[n] the slots past the rows' lengths in [G * P] order, None if none."""
        if all(n == self.padded for n in self.lengths):
            return None
        return self._past_mask.view(-1).nonzero().squeeze(1)

    def operands(self, k_cache, v_cache, k, v) -> _Layer:
        """The layer's copy (keys [Hkv * G, D, P], values [Hkv * G, P, D]): the last step's plus
        this step's k/v where reused, else gathered."""
        key = (k_cache.data_ptr(), v_cache.data_ptr())
        layer = self.layers.get(key)
        reusable = layer is not None and layer.k_cache is k_cache and layer.v_cache is v_cache
        if self.reused and reusable:
            self._append(layer, k, v)
            return layer
        layer = self.layers[key] = _Layer(
            k_cache, v_cache, self._gather(k_cache, v_cache), self.rows
        )
        return layer

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

    def _append(self, layer: _Layer, k, v) -> None:
        """The rows' new k/v (what the cache now holds at each row's last slot) into the copy."""
        k_cache, v_cache, rows = layer.k_cache, layer.v_cache, layer.rows
        if k is not None and k.dtype == k_cache.dtype == torch.float32:
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

    def buffers(self, hkv: int, group: int, d: int) -> _Buffers:
        """The step's GEMM operands and results for layers of this shape (made by the first)."""
        key = (hkv, group, d)
        found = self._buffers.get(key)
        if found is None:
            found = self._buffers[key] = _Buffers(self, hkv, group, d)
        return found


class _Layer:
    """One layer's copy [2, Hkv, G, P, D] of the rows' K/V and its views."""

    __slots__ = ("k_cache", "v_cache", "kv", "keys", "values", "rows")

    def __init__(self, k_cache, v_cache, kv: torch.Tensor, g: int) -> None:
        self.k_cache, self.v_cache, self.kv = k_cache, v_cache, kv
        hkv, padded, d = kv.shape[1], kv.shape[3], kv.shape[4]
        self.keys = kv[0].view(hkv * g, padded, d).transpose(1, 2)  # [Hkv * G, D, P]
        self.values = kv[1].view(hkv * g, padded, d)
        self.rows = kv.view(2, hkv, g * padded, d)  # slot g * P + i: row g's key i


class _Buffers:
    """A step's q rows zero-padded to at least MIN_GEMM_ROWS a GEMM (the pad rows stay zero,
    each run writes the real ones), the mask, and one tile's scores and output."""

    def __init__(self, rows: DecodeRows, hkv: int, group: int, d: int) -> None:
        g, m = rows.rows, max(group, MIN_GEMM_ROWS)
        q_padded = torch.zeros(hkv, g, m, d)
        self.q = q_padded.view(hkv * g, m, d)
        self.q_real = q_padded[:, :, :group]  # [Hkv, G, group, D]
        self.q_strides: dict[int, tuple] = {}  # q's row stride -> q viewed as q_real
        self.shape = (hkv, g, group, d)
        self.hide = self.bias = None
        if rows.bias is not None:  # -inf past the lengths, [Hkv * G, 1, P]
            self.bias = rows.bias.repeat(hkv, 1, 1)
            bias = rows.bias

            def hide(scores: torch.Tensor, c0: int, c1: int) -> None:
                scores.view(hkv, g, -1, c1 - c0).add_(bias[..., c0:c1])

            self.hide = hide
        self.scores = self.out = self.out_real = None
        if rows.padded <= rows.tile:  # one tile: its scores and output kept for every layer
            self.scores = torch.empty(hkv * g, m, rows.padded)
            self.out = torch.empty(hkv * g, m, d)
            self.out_real = self.out.view(hkv, g, m, d)[:, :, :group].transpose(0, 1)
        self.target: torch.Tensor | None = None  # the last run's out, and its [G, Hkv, group, D]
        self.target_view: torch.Tensor | None = None

    def q_heads(self, q: torch.Tensor) -> torch.Tensor:
        """q [G, Hq, D] (rows of any stride, heads dense) as [Hkv, G, group, D]."""
        hkv, g, group, d = self.shape
        row = q.stride(0)
        strides = self.q_strides.get(row)
        if strides is None:
            strides = self.q_strides[row] = (group * d, row, d, 1)
        return q.as_strided((hkv, g, group, d), strides)

    def target_of(self, out: torch.Tensor) -> torch.Tensor:
        """out [G, Hq, D] as [G, Hkv, group, D] (the model passes one out to every layer)."""
        if out is not self.target:
            hkv, g, group, d = self.shape
            self.target, self.target_view = out, out.view(g, hkv, group, d)
        return self.target_view


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
        d = q.shape[2]
        hkv = k_cache.shape[1]
        layer = r.operands(k_cache, v_cache, k, v)
        buffers = r.buffers(hkv, q.shape[1] // hkv, d)
        folded, scale = self._scales(d)
        if q.stride(2) == 1 and q.stride(1) == d:
            q_heads = buffers.q_heads(q)
        else:
            q_heads = q.view(q.shape[0], hkv, -1, d).transpose(0, 1)
        if folded is None:
            buffers.q_real.copy_(q_heads)
        elif q.dtype == torch.float32:
            torch.mul(q_heads, folded, out=buffers.q_real)
        else:
            buffers.q_real.copy_(q_heads).mul_(folded)
        if buffers.scores is not None and scale is None and self.soft_cap is None:
            # one tile, scale folded: tiled_attention's ops into the step's buffers
            scores = torch.bmm(buffers.q, layer.keys, out=buffers.scores)
            if buffers.bias is not None:
                scores.add_(buffers.bias)
            torch.bmm(torch.softmax(scores, dim=-1), layer.values, out=buffers.out)
            o = buffers.out_real
        else:
            o, _ = tiled_attention(
                buffers.q, layer.keys, layer.values, scale, buffers.hide, r.padded, r.tile,
                self.soft_cap, open_until=r.nearest, alive_until=r.nearest,
            )  # fmt: skip
            o = o.view(hkv, q.shape[0], -1, d)[:, :, : q.shape[1] // hkv].transpose(0, 1)
        if self.v_scale is not None:
            o = o * self.v_scale
        buffers.target_of(out).copy_(o)
        return out
