"""layout_batch (numpy, whole-array) against the straightforward per-token construction it
replaced, kept here as the reference: random batches of prefill chunks and decodes, odd block
sizes, padded widths, chosen logits rows; the same errors for bad chunks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkern.model import BatchLayout, SequenceChunk, build_batch, layout_batch


def reference_layout(chunks, block_size, max_blocks=None, logits_rows=None) -> dict:
    """The former layout_batch: a Python loop over sequences and their tokens."""
    if not chunks:
        raise ValueError("a batch needs at least one sequence")
    num_decodes = 0
    for chunk in reversed(chunks):
        if len(chunk.token_ids) != 1:
            break
        num_decodes += 1
    width = max_blocks if max_blocks is not None else max(len(c.block_table) for c in chunks)
    ids, positions, slots, cu, tables, seq_lens = [], [], [], [0], [], []
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
    return dict(
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


def random_batch(rng: random.Random):
    block_size = rng.choice([1, 3, 16])
    num_blocks = 4096
    chunks = []
    for _ in range(rng.randint(1, 40)):
        n = 1 if rng.random() < 0.6 else rng.randint(1, 70)
        start = rng.choice([0, rng.randint(0, 300)])
        need = -(-(start + n) // block_size)
        table = rng.sample(range(num_blocks), need + rng.choice([0, 0, 1, 2]))
        chunks.append(SequenceChunk([rng.randrange(50000) for _ in range(n)], start, table))
    if rng.random() < 0.5:  # the runner's order: prefill chunks, then decodes
        chunks.sort(key=lambda c: len(c.token_ids) == 1)
    widest = max(len(c.block_table) for c in chunks)
    max_blocks = rng.choice([None, widest, widest + 5])
    logits_rows = rng.choice(
        [None, sorted(rng.sample(range(len(chunks)), rng.randint(0, len(chunks))))]
    )
    return chunks, block_size, max_blocks, logits_rows


@pytest.mark.parametrize("seed", range(200))
def test_layout_equals_per_token_construction(seed):
    chunks, block_size, max_blocks, logits_rows = random_batch(random.Random(seed))
    expected = reference_layout(chunks, block_size, max_blocks, logits_rows)
    layout = layout_batch(chunks, block_size, max_blocks, logits_rows)
    for name, value in expected.items():
        got = getattr(layout, name)
        got = got if isinstance(got, int) else [int(x) for x in got]
        assert got == value, name
    # The packed buffer is exactly the parts in order, and uploads to the same metadata.
    flat = [
        x
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "cu_seqlens",
            "block_tables",
            "seq_lens",
            "logits_indices",
        )
        for x in expected[name]
    ]
    assert layout.pack().dtype == torch.int32 and layout.pack().tolist() == flat
    ids, meta = layout.upload("cpu")
    assert ids.tolist() == expected["input_ids"]
    assert meta.slot_mapping.tolist() == expected["slot_mapping"]
    assert meta.block_tables.shape == (len(chunks), expected["width"])
    assert meta.max_seq_len == max(expected["seq_lens"])
    assert meta.num_prefill_tokens == expected["cu_seqlens"][expected["num_prefills"]]


def test_hand_built_layout_of_lists_packs_the_same():
    """A BatchLayout built from plain lists (not by layout_batch) packs and unpacks alike."""
    chunks, block_size, max_blocks, logits_rows = random_batch(random.Random(7))
    layout = layout_batch(chunks, block_size, max_blocks, logits_rows)
    by_hand = BatchLayout(**reference_layout(chunks, block_size, max_blocks, logits_rows))
    assert torch.equal(by_hand.pack(), layout.pack())
    (ids_a, meta_a), (ids_b, meta_b) = by_hand.upload(), layout.upload()
    assert torch.equal(ids_a, ids_b) and torch.equal(meta_a.block_tables, meta_b.block_tables)
    assert (meta_a.max_seq_len, meta_a.num_prefill_tokens) == (
        meta_b.max_seq_len,
        meta_b.num_prefill_tokens,
    )


@pytest.mark.parametrize(
    "chunks, max_blocks",
    [
        ([SequenceChunk([1], 0, [0]), SequenceChunk([], 3, [1])], None),
        ([SequenceChunk([1], 0, [0]), SequenceChunk([2], -1, [1])], None),
        ([SequenceChunk([1, 2], 0, [0]), SequenceChunk([1, 2, 3, 4, 5], 0, [1])], None),
        ([SequenceChunk([1], 0, [0, 1, 2])], 2),
        ([SequenceChunk([1], 7, [0]), SequenceChunk([], 0, [1])], None),  # first error wins
    ],
)
def test_same_errors_as_the_reference(chunks, max_blocks):
    with pytest.raises(ValueError) as expected:
        reference_layout(chunks, 4, max_blocks)
    with pytest.raises(ValueError) as got:
        build_batch(chunks, 4, max_blocks=max_blocks)
    assert str(got.value) == str(expected.value)


def test_a_replaced_field_is_packed_afresh():
    """Padding a layout by replacing a field (as CUDA-graph code may) must reach the buffer."""
    chunks = [SequenceChunk([5], 3, [2]), SequenceChunk([6], 0, [1])]
    layout = layout_batch(chunks, 4)
    layout.input_ids = [9, 8]
    assert layout.pack().tolist()[:2] == [9, 8]
    ids, _ = layout.upload()
    assert ids.tolist() == [9, 8]
