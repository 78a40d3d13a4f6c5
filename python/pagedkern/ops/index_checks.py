"""Contents of the index arrays, checked before the reference ops follow them (torch tensors).

Validation elsewhere checks shapes and dtypes; these check values: block ids inside the cache,
positions inside the RoPE table, lengths that fit the block table, query bounds that add up,
sampling's token entries and mask rows. On the reference path reading them costs nothing extra
(the reference reads them on the host anyway); the kernels never read indices back (that would
sync), and check them on the device in the PAGEDKERN_CHECK_INDICES=1 debug mode instead (sample's
kernels skip a token id outside the vocabulary). Each error names the argument and the entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a check runs: CuPy users never load torch
    import torch


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _outside(x: torch.Tensor, low: int, end: int) -> bool:
    """Whether an entry of x is outside [low, end): one pass for both bounds (the step's
    checks run on every decode step)."""
    import torch

    if x.numel() == 0:
        return False
    smallest, largest = torch.aminmax(x)
    return int(smallest) < low or int(largest) >= end


def check_block_table_contents(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """seq_lens[b] in [0, width * block_size]; the ids of the pages holding them in
    [0, num_blocks) (entries past a sequence's pages are padding and never read)."""
    import torch

    lens = seq_lens.long()
    width = block_tables.shape[1]
    if (lens < 0).any():
        (b,) = _first(lens < 0)
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} is negative")
    capacity = width * block_size
    if (lens > capacity).any():
        (b,) = _first(lens > capacity)
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} exceeds the block table's capacity of {width} "
            f"blocks x {block_size} = {capacity} keys (block_tables shape "
            f"{tuple(block_tables.shape)})"
        )
    pages = (lens + block_size - 1) // block_size
    used = torch.arange(width, device=lens.device)[None, :] < pages[:, None]
    ids = block_tables.long()
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bad.any():
        b, j = _first(bad)
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(ids[b, j])} is not a block id of the cache "
            f"([0, {num_blocks})), and sequence {b} reads it (seq_lens[{b}] = {int(lens[b])})"
        )


def check_query_bounds(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, total_q: int) -> None:
    """cu_seqlens_q rises from 0 to total_q; each chunk fits its sequence (n_b <= seq_lens[b])."""
    cu = cu_seqlens_q.long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q[0] = {int(cu[0])} must be 0")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        (b,) = _first(steps < 0)
        raise ValueError(
            f"cu_seqlens_q must not decrease: cu_seqlens_q[{b + 1}] = {int(cu[b + 1])} < "
            f"cu_seqlens_q[{b}] = {int(cu[b])}"
        )
    if int(cu[-1]) != total_q:
        raise ValueError(
            f"cu_seqlens_q[-1] = {int(cu[-1])} must equal the number of query rows {total_q}"
        )
    short = steps > seq_lens.long()
    if short.any():
        (b,) = _first(short)
        raise ValueError(
            f"seq_lens[{b}] = {int(seq_lens[b])} is shorter than its query chunk "
            f"({int(steps[b])} rows of cu_seqlens_q)"
        )


def check_rope_indices(
    positions: torch.Tensor, slot_mapping: torch.Tensor, max_positions: int, num_slots: int
) -> None:
    """positions in [0, max_positions) (rows of cos_sin); slot_mapping -1 or in [0, num_slots)."""
    if _outside(positions, 0, max_positions):
        pos = positions.long()
        (t,) = _first((pos < 0) | (pos >= max_positions))
        raise ValueError(
            f"positions[{t}] = {int(pos[t])} is outside the cos_sin table ([0, {max_positions}))"
        )
    if _outside(slot_mapping, -1, num_slots):
        slots = slot_mapping.long()
        (t,) = _first((slots < -1) | (slots >= num_slots))
        raise ValueError(
            f"slot_mapping[{t}] = {int(slots[t])} is neither -1 (no write) nor a cache slot "
            f"([0, {num_slots}))"
        )


def check_sampling_indices(
    token_offsets: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    bitmask_rows: torch.Tensor | None,
    vocab: int,
    num_masks: int,
) -> None:
    """sample's logits processing: token_offsets rises from 0 to nnz (row r's entries are
    token_ids[token_offsets[r]:token_offsets[r + 1]]), token_ids in [0, vocab), bitmask_rows
    negative (no mask) or a row of the bitmask ([0, num_masks))."""
    if token_offsets is not None and token_ids is not None:
        offsets = token_offsets.long()
        if int(offsets[0]) != 0:
            raise ValueError(f"token_offsets[0] = {int(offsets[0])} must be 0")
        steps = offsets[1:] - offsets[:-1]
        if (steps < 0).any():
            (r,) = _first(steps < 0)
            raise ValueError(
                f"token_offsets must not decrease: token_offsets[{r + 1}] = "
                f"{int(offsets[r + 1])} < token_offsets[{r}] = {int(offsets[r])}"
            )
        nnz, last = token_ids.shape[0], offsets.shape[0] - 1
        if int(offsets[last]) != nnz:
            raise ValueError(
                f"token_offsets[{last}] = {int(offsets[last])} must equal the number of entries "
                f"{nnz} (the length of token_ids)"
            )
        if _outside(token_ids, 0, vocab):
            ids = token_ids.long()
            (j,) = _first((ids < 0) | (ids >= vocab))
            raise ValueError(
                f"token_ids[{j}] = {int(ids[j])} is not a token id of the vocabulary ([0, {vocab}))"
            )
    if bitmask_rows is not None and _outside(bitmask_rows, -(2**31), num_masks):
        rows = bitmask_rows.long()
        (r,) = _first(rows >= num_masks)
        raise ValueError(
            f"bitmask_rows[{r}] = {int(rows[r])} is neither negative (no mask) nor a row of "
            f"bitmask ([0, {num_masks}))"
        )
