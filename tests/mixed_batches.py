"""Mixed batches for the piecewise-graph tests (CPU and GPU): prefill chunks, each after a
cached prefix of random length, then one-token decodes, on disjoint runs of KV blocks."""

from __future__ import annotations

import random

from pagedkern.model import SequenceChunk


def mixed_batch(
    seed: int,
    prefill_lens: list[int],
    num_decodes: int,
    block_size: int,
    vocab: int,
    max_prefix: int,
) -> list[SequenceChunk]:
    rng = random.Random(seed)
    chunks, next_block = [], 0
    for length in [*prefill_lens, *[1] * num_decodes]:
        computed = rng.randrange(0 if length > 1 else 1, max_prefix)
        blocks = -(-(computed + length) // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        chunks.append(SequenceChunk([rng.randrange(vocab) for _ in range(length)], computed, table))
    return chunks
