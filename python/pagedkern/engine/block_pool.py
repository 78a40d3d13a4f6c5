"""Paged KV memory: a fixed pool of blocks, a free list in eviction order, reference counts and a
prefix cache of full blocks keyed by chained hashes (vLLM's automatic prefix caching).

A block is *in use* while some request's block table holds it (ref_count > 0), otherwise *free*.
A free block may still be *cached*: it keeps its hash and can be taken back by a later request
whose prompt starts with the same tokens, until allocation evicts it. Eviction order: blocks that
were never cached first, then cached ones least recently released first, and within one request
its last block first (deep prefix blocks are the least likely to be shared).

Windowed models (every layer a sliding window) release the blocks no future query can see
(Scheduler.release_outside_window). A block table stays positional (entry j holds tokens
[j bs, (j + 1) bs)), so a released entry is replaced by the pool's *null block*: a reserved id,
never allocated, freed or cached, that the attention kernels never read (a window starts past
it). It is neither in use nor free, nor one of the pool's `num_blocks` (the blocks requests can
hold): an idle engine reports no block in use, and its total is what requests can take. A
released block that was cached keeps its hash like any freed block: its K/V for those tokens
stay valid until allocation evicts it (and then its hash goes with it), so a later prefix hit
on it is correct for every layer: one pool serves all layers, none of which has dropped it
alone. Hybrid local/global models give each layer group its own table over this one pool
(engine/hybrid_tables.py), their blocks cached under group-salted hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


_blake2b = hashlib.blake2b


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Hash of a full block given its parent's hash: equal hashes mean equal whole prefixes.
    BLAKE2b (128 bit) so that a collision, which would silently reuse wrong K/V, is negligible."""
    return _blake2b((parent or b"root") + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        reserve_null_block: bool = False,
    ):
        """reserve_null_block: keep block 0 as the null block (windowed release; see above)."""
        if num_blocks < 1 + reserve_null_block or block_size < 1:
            raise ValueError(
                f"need num_blocks >= {1 + reserve_null_block} and block_size >= 1, got "
                f"{num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.null_block: int | None = None  # stands for released table entries
        if reserve_null_block:
            self.null_block = 0
            del self._free[0]
            self.blocks[0].ref_count = 1  # one permanent reference: never allocated nor freed
        self._cached: dict[bytes, int] = {}
        # Blocks in use per layer kind (0 full, 1 sliding: engine/hybrid_tables.py), now and
        # at most so far; a block's kind is the one it was allocated for (the null one's none).
        self._kind = bytearray(num_blocks)
        self.used_by_kind = [0, 0]
        self.peak_by_kind = [0, 0]
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found in the cache

    @property
    def num_blocks(self) -> int:
        """The blocks requests can hold: num_used + num_free, the null block not among them."""
        return len(self.blocks) - (self.null_block is not None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by requests (the null block is reserved, not used)."""
        return self.num_blocks - len(self._free)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(
        self, token_ids: Sequence[int], known: list[bytes] | None = None
    ) -> list[bytes]:
        """Chained hashes of every full block of token_ids, extending `known` (a prefix)."""
        hashes = list(known or [])
        self.extend_hashes(hashes, token_ids[len(hashes) * self.block_size :])
        return hashes

    def extend_hashes(self, hashes: list[bytes], token_ids: Sequence[int]) -> None:
        """Append to `hashes` the chained hashes of the full blocks of `token_ids`, the ids
        that follow the blocks `hashes` already covers (a decode step hashes the one block it
        filled, not the whole sequence)."""
        bs = self.block_size
        for j in range(len(token_ids) // bs):
            hashes.append(
                chain_hash(hashes[-1] if hashes else None, token_ids[j * bs : (j + 1) * bs])
            )

    def lookup_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached prefix (at most max_blocks), not yet acquired."""
        found = []
        if self.enable_prefix_caching:
            for h in hashes[:max_blocks]:
                block_id = self._cached.get(h)
                if block_id is None:
                    break
                found.append(block_id)
        return found

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the prefix `block_hash`, if cached (not yet acquired)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (prefix hits; null entries are skipped)."""
        for block_id in block_ids:
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._count_use(self._kind[block_id], 1)
            block.ref_count += 1

    def allocate(self, n: int, kind: int = 0) -> list[int] | None:
        """n fresh blocks (evicting cached free ones as needed), or None if fewer are free;
        kind: the layer kind they serve (counted in used_by_kind)."""
        if n > len(self._free):
            return None
        taken = []
        kinds = self._kind
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            kinds[block_id] = kind
            taken.append(block_id)
        self._count_use(kind, n)
        return taken

    def _count_use(self, kind: int, n: int) -> None:
        used = self.used_by_kind[kind] = self.used_by_kind[kind] + n
        if used > self.peak_by_kind[kind]:
            self.peak_by_kind[kind] = used

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; blocks reaching zero become free (cached ones stay
        findable until evicted); null entries (released ones) are skipped."""
        for block_id in reversed(block_ids):
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_by_kind[self._kind[block_id]] -= 1
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # evict uncached ones first

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Mark a full, computed block as holding the prefix `block_hash`."""
        if not self.enable_prefix_caching or block_id == self.null_block:
            return
        block = self.blocks[block_id]
        if block.block_hash is None:
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, block_id)

    def check_invariants(self, block_tables: Iterable[Sequence[int]]) -> None:
        """blocks in use + free == num_blocks; ref counts equal the uses in the live block tables;
        the prefix cache points at blocks that hold the hash. AssertionError otherwise."""
        uses = [0] * len(self.blocks)
        for table in block_tables:
            for block_id in table:
                uses[block_id] += 1
        if self.null_block is not None:  # any number of table entries, one permanent reference
            uses[self.null_block] = 1
        in_use = sum(1 for b in self.blocks if b.ref_count > 0 and b.block_id != self.null_block)
        assert in_use + len(self._free) == self.num_blocks, "in use + free != total"
        for block in self.blocks:
            uses_of = uses[block.block_id]
            assert block.ref_count == uses_of, (
                f"block {block.block_id}: ref_count {block.ref_count} != {uses_of} uses"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), "free list mismatch"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, "stale prefix-cache entry"
        for kind, used in enumerate(self.used_by_kind):
            held = sum(
                1
                for b in self.blocks
                if b.ref_count and self._kind[b.block_id] == kind and b.block_id != self.null_block
            )
            assert used == held, f"kind {kind}: {used} counted in use, {held} held"
