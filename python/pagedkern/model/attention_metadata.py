"""What one forward call needs to know about its flattened (varlen) batch, and a builder for it.

A step of the engine runs B sequences at once: some feed a prompt chunk (prefill), the others one
new token (decode). Their new tokens are concatenated into input_ids [T]: the prefill sequences
first, then the decode sequences, so attention runs flash_prefill on rows [0, num_prefill_tokens)
and paged_attention on the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain, repeat
from operator import add, attrgetter, le, mul, sub

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Batch layout for LlamaModel.forward. All tensors int32 on the model's device.

    Sequence b (0 <= b < B; sequences 0..num_prefills-1 are prefills, the rest decodes) owns
    rows cu_seqlens[b]:cu_seqlens[b+1] of the batch (one row for a decode).

    positions     [T]      position of each token in its sequence (RoPE angle).
    slot_mapping  [T]      KV-cache slot each token's k/v is written to:
                           block_table[pos // block_size] * block_size + pos % block_size;
                           -1 skips the write (padding rows).
    cu_seqlens    [B+1]    row offsets of the sequences, cu_seqlens[0] = 0.
    block_tables  [B, M]   physical block ids of each sequence, in logical order (padded).
    seq_lens      [B]      tokens of each sequence in the cache once this step's are written
                           (cached prefix + new tokens): what attention reads.
    logits_indices [N]     rows whose final hidden state goes through the LM head, one per
                           requested logit row (default: the last row of every sequence).
    num_prefills          B_p, sequences run by flash_prefill.
    num_prefill_tokens    cu_seqlens[B_p], rows run by flash_prefill.
    max_query_len, max_seq_len   host-side maxima (kernel launch sizes without a device sync).
    group_block_tables, group_slot_mappings   a hybrid cache's per-kind tables (model/kv_cache.py
                           KVLayerGroups): [B, M] and [T] of groups 1.. (group 0's are the
                           fields above); empty for one table.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int
    max_seq_len: int
    group_block_tables: tuple[torch.Tensor, ...] = ()
    group_slot_mappings: tuple[torch.Tensor, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` reads: its block tables and slots."""
        if group == 0:
            return self
        return replace(
            self,
            block_tables=self.group_block_tables[group - 1],
            slot_mapping=self.group_slot_mappings[group - 1],
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's part of a step: token_ids are its new tokens, at positions
    num_computed, num_computed+1, ...; block_table lists its physical KV blocks and must cover
    every position up to num_computed + len(token_ids) - 1."""

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]
    group_tables: Sequence[Sequence[int]] = ()  # a hybrid cache's groups 1.. (as long)


@dataclass(slots=True)
class BatchLayout:
    """The host-side content of a batch: what build_batch uploads. Kept separate so the engine
    can pad it (CUDA-graph buckets) or place it in its own buffers. layout_batch fills it with
    int32 numpy views of the one buffer `pack()` returns (so packing copies nothing); one built
    by hand may hold plain int sequences instead."""

    input_ids: Sequence[int]
    positions: Sequence[int]
    slot_mapping: Sequence[int]
    cu_seqlens: Sequence[int]
    block_tables: Sequence[int]  # row-major [num_seqs, width]
    width: int
    seq_lens: Sequence[int]
    logits_indices: Sequence[int]
    num_prefills: int
    max_query_len: int
    _packed: np.ndarray | None = field(default=None, repr=False, compare=False)
    # a hybrid cache's groups 1..: per group (block tables row-major [B, width], slots [T])
    groups: Sequence[tuple[Sequence[int], Sequence[int]]] = ()

    def upload(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, AttentionMetadata]:
        """input_ids and metadata on `device`, from ONE int32 host buffer (pinned for CUDA) and
        one non-blocking copy: per-step host-to-device traffic is a single transfer. On the
        CPU the tensors share the layout's own arrays."""
        device = torch.device(device)
        if device.type == "cpu":  # the host arrays serve as they are
            return self._host_tensors()
        host = self.pack()
        if device.type == "cuda":
            host = host.pin_memory()
        return self.unpack(host.to(device, non_blocking=True))

    def _host_tensors(self) -> tuple[torch.Tensor, AttentionMetadata]:
        """input_ids and metadata as CPU tensors sharing the host arrays (those of
        layout_batch are int32 views already: nothing is copied, no packed tensor is split)."""
        parts = [np.asarray(p, dtype=np.int32) for p in self._parts()]
        b = len(parts[5])
        parts[4] = parts[4].reshape(b, self.width)
        parts[7::2] = [p.reshape(b, self.width) for p in parts[7::2]]
        ids, positions, slots, cu, tables, seq_lens, logits, *groups = map(torch.from_numpy, parts)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            cu_seqlens=cu,
            block_tables=tables,
            seq_lens=seq_lens,
            logits_indices=logits,
            num_prefills=self.num_prefills,
            num_prefill_tokens=int(parts[3][self.num_prefills]),
            max_query_len=self.max_query_len,
            max_seq_len=int(parts[5].max()),
            group_block_tables=tuple(groups[0::2]),
            group_slot_mappings=tuple(groups[1::2]),
        )
        return ids, meta

    def _parts(self) -> tuple[Sequence[int], ...]:
        """The fields in pack() order (a hybrid cache's group tables and slots last)."""
        return (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.cu_seqlens,
            self.block_tables,
            self.seq_lens,
            self.logits_indices,
            *(part for group in self.groups for part in group),
        )

    def sizes(self) -> list[int]:
        """Lengths of the packed buffer's parts, in pack() order."""
        t, b = len(self.input_ids), len(self.seq_lens)
        return [t, t, t, b + 1, b * self.width, b, len(self.logits_indices)] + [
            b * self.width,
            t,
        ] * len(self.groups)

    def pack(self) -> torch.Tensor:
        """The one int32 host buffer: input_ids, positions, slot_mapping, cu_seqlens,
        block_tables, seq_lens, logits_indices (tensor parallelism broadcasts this buffer).
        From layout_batch it is the buffer its arrays view (shared memory: no copy); a field
        since replaced by another sequence, or a layout built by hand, is packed afresh."""
        parts = self._parts()
        packed = self._packed
        if packed is None or any(getattr(p, "base", None) is not packed for p in parts):
            packed = np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])
        return torch.from_numpy(packed)

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
        """input_ids and metadata as views of `flat` (pack()'s buffer, on any device)."""
        return unpack_batch(
            flat,
            self.sizes(),
            len(self.seq_lens),
            self.width,
            self.num_prefills,
            int(self.cu_seqlens[self.num_prefills]),
            self.max_query_len,
            int(np.max(self.seq_lens)),
        )


def unpack_batch(
    flat: torch.Tensor,
    sizes: list[int],
    num_seqs: int,
    width: int,
    num_prefills: int,
    num_prefill_tokens: int,
    max_query_len: int,
    max_seq_len: int,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """input_ids [T] and AttentionMetadata as views of a packed buffer (BatchLayout.pack), from
    its part sizes and host-side counts (a TP worker gets these in the step header); parts
    past the seventh are a hybrid cache's (group tables, group slots) pairs."""
    views = flat.split(sizes)
    meta = AttentionMetadata(
        positions=views[1],
        slot_mapping=views[2],
        cu_seqlens=views[3],
        block_tables=views[4].view(num_seqs, width),
        seq_lens=views[5],
        logits_indices=views[6],
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        group_block_tables=tuple(v.view(num_seqs, width) for v in views[7::2]),
        group_slot_mappings=tuple(views[8::2]),
    )
    return views[0], meta


def verification_rows(chunk: SequenceChunk) -> list[SequenceChunk]:
    """A speculative verification chunk (a sequence's last token and its k proposals) as 1 + k
    one-token decode rows sharing its block table: row j at position num_computed + j attends
    to seq_len = num_computed + j + 1 tokens, the K/V of rows < j included (every row's K/V
    is written before attention runs). The decode-style path for short chunks: paged_attention
    fills no 128-row Q tile with 1 + k rows (kernel notes in csrc/paged_attention.cu)."""
    table, groups = chunk.block_table, chunk.group_tables
    return [
        SequenceChunk(chunk.token_ids[j : j + 1], chunk.num_computed + j, table, groups)
        for j in range(len(chunk.token_ids))
    ]


def layout_batch(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    max_blocks: int | None = None,
    logits_rows: Sequence[int] | None = None,
) -> BatchLayout:
    """The batch for `chunks`, kept in the given order. The trailing run of one-token chunks runs
    as decodes, everything before it as prefill, so callers list prefill chunks first.
    block_tables are padded with 0 to max_blocks (default: the longest table). Logits are
    computed for the last token of chunks[r] for r in logits_rows (default: every chunk).

    Cost: per-sequence values come from C-level passes (map, accumulate, min/max) over the
    chunks, and the whole packed buffer from ONE np.fromiter over their chain, each int
    converted once. No per-token Python work: a decode's slot is one expression per sequence,
    prefill rows' slots are one numpy gather. Few numpy calls, on purpose: each costs
    microseconds when the step has left the caches cold, more than a decode's whole row."""
    b = len(chunks)
    if not b:
        raise ValueError("a batch needs at least one sequence")
    tokens = list(map(_token_ids, chunks))
    tables = list(map(_block_table, chunks))
    starts = list(map(_num_computed, chunks))
    lens = list(map(len, tokens))
    table_lens = list(map(len, tables))
    ends = list(map(add, starts, lens))
    width = max_blocks if max_blocks is not None else max(table_lens)
    if (
        min(lens) < 1
        or min(starts) < 0
        or max(table_lens) > width
        or not all(map(le, ends, map(mul, table_lens, repeat(block_size))))
    ):
        _raise_first_bad(lens, starts, table_lens, block_size, width)
    t = sum(lens)
    decode = t == b  # every chunk one token (lens >= 1): one row per sequence
    num_prefills = 0 if decode else b - next(i for i, n in enumerate(reversed(lens)) if n != 1)
    cu = list(accumulate(lens, initial=0))
    if logits_rows is None:
        logits = cu[1:]
    else:
        logits = list(map(cu.__getitem__, map(add, logits_rows, repeat(1))))
    bs = block_size
    if decode:
        positions: Iterable[int] = starts
        slots: Iterable[int] = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]
    else:
        positions = chain.from_iterable(map(range, starts, ends))
        slots = repeat(0, t)  # filled below, vectorised
    pads = map(mul, repeat([0]), map(sub, repeat(width), table_lens))
    sizes = [t, t, t, b + 1, b * width, b, len(logits)]
    packed = np.fromiter(
        chain(
            chain.from_iterable(tokens),
            positions,
            slots,
            cu,
            chain.from_iterable(map(add, tables, pads)),
            ends,
            logits,
        ),
        np.int32,
        sum(sizes),
    )
    ids, positions, slots, cu_seqlens, table_rows, seq_lens, logits_indices = split_packed(
        packed, sizes
    )
    logits_indices -= 1  # the last row of each chosen sequence: cu[r + 1] - 1
    if not decode:
        rows = table_rows.reshape(b, width)
        seq = np.repeat(np.arange(b), lens)
        slots[:] = rows[seq, positions // bs] * np.int64(bs) + positions % bs
    groups = _group_parts(chunks, width, bs, positions, lens) if chunks[0].group_tables else ()
    return BatchLayout(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens=cu_seqlens,
        block_tables=table_rows,
        width=width,
        seq_lens=seq_lens,
        logits_indices=logits_indices,
        num_prefills=num_prefills,
        max_query_len=max(lens),
        _packed=packed,
        groups=groups,
    )


def _group_parts(
    chunks: Sequence[SequenceChunk],
    width: int,
    block_size: int,
    positions: np.ndarray,
    lens: list[int],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A hybrid cache's groups 1..: (tables padded to `width`, row-major; slots of the rows at
    `positions`) per group. Every chunk has as many group tables as block_table's length.
    One C-level pass per group builds its rows (as layout_batch builds block_tables)."""
    num_groups = len(chunks[0].group_tables)
    b = len(chunks)
    table_lens = list(map(len, map(_block_table, chunks)))
    seq = np.repeat(np.arange(b), lens)
    block, offset = positions // block_size, positions % block_size
    pads = list(map(mul, repeat([0]), map(sub, repeat(width), table_lens)))
    bad = ValueError(f"every sequence needs {num_groups} group tables as long as its table")
    if any(len(chunk.group_tables) != num_groups for chunk in chunks):
        raise bad
    parts = []
    for g in range(num_groups):
        tables = [chunk.group_tables[g] for chunk in chunks]
        if list(map(len, tables)) != table_lens:
            raise bad
        rows = np.fromiter(
            chain.from_iterable(map(add, map(list, tables), pads)), np.int32, b * width
        )
        slots = rows.reshape(b, width)[seq, block].astype(np.int64) * block_size + offset
        parts.append((rows, slots.astype(np.int32)))
    return parts


def split_packed(packed: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Consecutive views of `packed` of the given sizes."""
    views, start = [], 0
    for n in sizes:
        views.append(packed[start : start + n])
        start += n
    return views


def _raise_first_bad(
    lens: list[int], starts: list[int], table_lens: list[int], block_size: int, width: int
) -> None:
    """The error for the first sequence layout_batch cannot lay out (its checks are batched)."""
    for s, (n, start, blocks) in enumerate(zip(lens, starts, table_lens, strict=True)):
        if n == 0 or start < 0:
            raise ValueError(f"sequence {s}: needs new tokens and num_computed >= 0")
        if blocks * block_size < start + n or blocks > width:
            raise ValueError(
                f"sequence {s}: block table of {blocks} blocks cannot hold {start + n} tokens "
                f"(block_size {block_size}, max_blocks {width})"
            )
    raise AssertionError("no bad sequence")  # unreachable: the batched checks found one


_token_ids = attrgetter("token_ids")
_num_computed = attrgetter("num_computed")
_block_table = attrgetter("block_table")


def build_batch(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    device: torch.device | str = "cpu",
    max_blocks: int | None = None,
    logits_rows: Sequence[int] | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """input_ids [T] int32 and the metadata for `chunks` on `device` (see layout_batch; logit
    row i belongs to chunks[logits_rows[i]], by default chunks[i])."""
    return layout_batch(chunks, block_size, max_blocks, logits_rows).upload(device)
