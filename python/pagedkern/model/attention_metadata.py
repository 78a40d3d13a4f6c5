"""What one forward call needs to know about its flattened (varlen) batch, and a builder for it.

A step of the engine runs B sequences at once: some feed a prompt chunk (prefill), the others one
new token (decode). Their new tokens are concatenated into input_ids [T]: the prefill sequences
first, then the decode sequences, so attention runs flash_prefill on rows [0, num_prefill_tokens)
and paged_attention on the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(slots=True)
class BatchLayout:
    """The host-side (Python ints) content of a batch: what build_batch uploads. Kept separate so
    the engine can pad it (CUDA-graph buckets) or place it in its own buffers."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens: list[int]
    block_tables: list[int]  # row-major [num_seqs, width]
    width: int
    seq_lens: list[int]
    logits_indices: list[int]
    num_prefills: int
    max_query_len: int

    def upload(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, AttentionMetadata]:
        """input_ids and metadata on `device`, from ONE int32 host buffer (pinned for CUDA) and
        one non-blocking copy: per-step host-to-device traffic is a single transfer."""
        device = torch.device(device)
        host = self.pack()
        if device.type == "cuda":
            host = host.pin_memory()
        return self.unpack(host.to(device, non_blocking=True))

    def sizes(self) -> list[int]:
        """Lengths of the packed buffer's parts, in pack() order."""
        t, b = len(self.input_ids), len(self.seq_lens)
        return [t, t, t, b + 1, b * self.width, b, len(self.logits_indices)]

    def pack(self) -> torch.Tensor:
        """The one int32 host buffer: input_ids, positions, slot_mapping, cu_seqlens,
        block_tables, seq_lens, logits_indices (tensor parallelism broadcasts this buffer)."""
        parts = (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.cu_seqlens,
            self.block_tables,
            self.seq_lens,
            self.logits_indices,
        )
        return torch.tensor([x for part in parts for x in part], dtype=torch.int32)

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
        """input_ids and metadata as views of `flat` (pack()'s buffer, on any device)."""
        return unpack_batch(
            flat,
            self.sizes(),
            len(self.seq_lens),
            self.width,
            self.num_prefills,
            self.cu_seqlens[self.num_prefills],
            self.max_query_len,
            max(self.seq_lens),
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
    its part sizes and host-side counts (a TP worker gets these in the step header)."""
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
    )
    return views[0], meta


def verification_rows(chunk: SequenceChunk) -> list[SequenceChunk]:
    """A speculative verification chunk (a sequence's last token and its k proposals) as 1 + k
    one-token decode rows sharing its block table: row j at position num_computed + j attends
    to seq_len = num_computed + j + 1 tokens, the K/V of rows < j included (every row's K/V
    is written before attention runs). The decode-style path for short chunks: paged_attention
    fills no 128-row Q tile with 1 + k rows (kernel notes in csrc/paged_attention.cu)."""
    table = chunk.block_table
    return [
        SequenceChunk(chunk.token_ids[j : j + 1], chunk.num_computed + j, table)
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
    computed for the last token of chunks[r] for r in logits_rows (default: every chunk)."""
    if not chunks:
        raise ValueError("a batch needs at least one sequence")
    num_decodes = 0
    for chunk in reversed(chunks):
        if len(chunk.token_ids) != 1:
            break
        num_decodes += 1

    width = max_blocks if max_blocks is not None else max(len(c.block_table) for c in chunks)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    tables: list[int] = []
    seq_lens: list[int] = []
    for b, chunk in enumerate(chunks):
        n, start = len(chunk.token_ids), chunk.num_computed
        end = start + n
        table = chunk.block_table
        if n == 0 or start < 0:
            raise ValueError(f"sequence {b}: needs new tokens and num_computed >= 0")
        if len(table) * block_size < end or len(table) > width:
            raise ValueError(
                f"sequence {b}: block table of {len(table)} blocks cannot hold {end} tokens "
                f"(block_size {block_size}, max_blocks {width})"
            )
        ids.extend(chunk.token_ids)
        positions.extend(range(start, end))
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        cu.append(cu[-1] + n)
        tables.extend(table)
        tables.extend([0] * (width - len(table)))
        seq_lens.append(end)
    rows = range(len(chunks)) if logits_rows is None else logits_rows
    return BatchLayout(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens=cu,
        block_tables=tables,
        width=width,
        seq_lens=seq_lens,
        logits_indices=[cu[r + 1] - 1 for r in rows],
        num_prefills=len(chunks) - num_decodes,
        max_query_len=max(len(c.token_ids) for c in chunks),
    )


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
