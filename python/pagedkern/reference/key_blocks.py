"""What the reference attention reads of the paged cache, and the padding that keeps it batch
invariant.

Keys are read in whole blocks: a sequence's pages from the first block its queries can see (0,
or a sliding window's) up to its last, gathered into dense fp32 tensors, the slots past its
length masked by position. Padding to whole blocks, and every GEMM of a (sequence, kv head)
given at least MIN_GEMM_ROWS query rows, make a query's bits independent of what else its step
carries (docs/ARCHITECTURE.md, batch invariance).
"""

from __future__ import annotations

import torch

# Bit-identical results wherever a query is computed (batch invariance: greedy outputs must not
# depend on what else a step carries, nor on decode vs prefill rows, chunking or preemption):
# every GEMM of a (sequence, kv head) gets at least MIN_GEMM_ROWS query rows, zero-padded, and
# its keys are padded to whole blocks. CPU BLASes round a product of few rows apart from the
# same rows among many (a Xeon's MKL: 1 row; an AMD EPYC's: 1-3 rows, measured from 4 to 160
# alike), and a score, softmax row or weighted sum apart at another width, except across
# whole-block widths (both measured on the EPYC up to ~200 keys).
MIN_GEMM_ROWS = 4


def with_min_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x zero-padded along `dim` to MIN_GEMM_ROWS rows (x itself when it has as many)."""
    missing = MIN_GEMM_ROWS - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def gather_sequence(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Keys or values 0..length-1 of one sequence as [Hkv, length, D] float32."""
    block_size = cache.shape[2]
    pages = cache[table[: (length + block_size - 1) // block_size].long()]  # [n, Hkv, bs, D]
    return pages.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :length].float()


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, dims: tuple[int, ...]):
    """Pages [S, n] of a cache [blocks, Hkv, bs, D] as a fresh float32 [S, Hkv, ...] tensor,
    the rest in `dims` order (1: page, 3: slot, 4: D). index_select copies whole [Hkv, bs, D]
    pages (cache[pages] walks them element by element)."""
    group, n = pages.shape
    pages_of = cache.index_select(0, pages.reshape(-1)).view(group, n, *cache.shape[1:])
    dense = pages_of.permute(0, 2, *dims)
    return torch.empty(dense.shape, device=cache.device).copy_(dense)


def first_block(length: int, first_query: int, window: int | None, block_size: int) -> int:
    """The first key block a sequence's queries read: 0, or with a window the block holding
    the oldest key its first query (at position first_query) sees. Older blocks are never
    read (a windowed layer reads ~window keys however long the sequence)."""
    return 0 if window is None else max(0, first_query - window + 1) // block_size


def key_blocks(tables, lengths, first: torch.Tensor, block_size: int):
    """(pages [G, span], key positions [G, span * block_size]): each sequence's blocks from
    `first` on, as many as the group's widest span; entries past a sequence's last block read
    page 0 (their positions are at or past its length: masked)."""
    nblk = -(-lengths // block_size)
    span = int((nblk - first).max())
    cols = first[:, None] + torch.arange(span, device=lengths.device)
    ids = tables.long().gather(1, cols.clamp(max=tables.shape[1] - 1))
    pages = torch.where(cols < nblk[:, None], ids, 0)
    offsets = torch.arange(block_size, device=lengths.device)
    positions = (cols[:, :, None] * block_size + offsets).reshape(len(lengths), -1)
    return pages, positions
