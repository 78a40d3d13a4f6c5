"""The scheduled requests' block tables over the BlockPool: one table per request, or per-kind
tables for a hybrid local/global model (engine/hybrid_tables.py, which this delegates to).

A request's table grows before a step needs its slots (`reserve`: all or nothing), shrinks
after verification rejects proposals (`roll_back`), loses the blocks no future query can see
on a windowed model (`release_outside_window`), and goes back whole when the request finishes
or is preempted (`release`). With prefix caching, a prompt starts from the longest cached
prefix (`prefix_hits`) and every block that fills with computed tokens becomes findable
(`register_full_blocks`); only blocks full of verified tokens ever enter the cache.
"""

from __future__ import annotations

from .block_pool import BlockPool
from .hybrid_tables import HybridTables
from .request import Request


class BlockTables:
    def __init__(
        self,
        pool: BlockPool,
        kv_window: int | None,
        group_windows: tuple[int | None, ...],
        chunk: int,
        copy_blocks: bool = True,
    ):
        """kv_window: every layer's sliding window (None: some layer sees every key).
        group_windows: per-kind tables' windows of groups 1.. (() for one table).
        chunk: the most tokens one step feeds a sequence (max_num_batched_tokens).
        copy_blocks: whether a block's K/V may be copied (SchedulerConfig.copy_blocks)."""
        self.pool = pool
        self.kv_window = kv_window
        self.copy_blocks = copy_blocks
        self.hybrid: HybridTables | None = None  # per-kind tables, if any
        if group_windows:
            self.hybrid = HybridTables(pool, (kv_window, *group_windows), chunk)

    def blocks_needed(self, num_tokens: int) -> int:
        """The blocks a sequence of `num_tokens` holds (every group's, with per-kind tables)."""
        hybrid = self.hybrid
        return (hybrid.blocks_needed if hybrid else self.pool.blocks_for)(num_tokens)

    def prefix_hits(self, request: Request) -> list[int]:
        """Acquire the cached blocks of the request's longest cached prefix (leaving at least one
        token to compute, whose logits give the next token)."""
        pool = self.pool
        request.block_hashes = pool.block_hashes(request.all_ids, request.block_hashes)
        max_blocks = (request.num_tokens - 1) // pool.block_size
        if request.params.prompt_logprobs is not None:
            max_blocks = 0  # every prompt position is computed (engine/prompt_logprobs.py)
        if self.hybrid is not None:  # every group's tables set, all their blocks acquired
            hits, num_hit = self.hybrid.prefix_hits(request, max_blocks)
        else:
            hits = pool.lookup_prefix(request.block_hashes, max_blocks)
            pool.acquire(hits)
            request.block_table = list(hits)  # right after acquire: a release frees these
            num_hit = len(hits)
        pool.prefix_queries += request.num_tokens
        pool.prefix_hits += num_hit * pool.block_size
        request.num_computed_tokens = request.num_cached_tokens = num_hit * pool.block_size
        return hits

    def drop_prefix_hits(self, request: Request, hits: list[int]) -> None:
        """Give back what `prefix_hits` acquired: the request was not admitted after all."""
        self.pool.free(hits)
        request.block_table.clear()
        request.num_computed_tokens = request.num_cached_tokens = 0

    def reserve(self, request: Request, num_new: int) -> bool:
        """Grow the request's tables to hold `num_new` more tokens; False (nothing taken) when
        the pool is short."""
        if self.hybrid is not None:
            blocks = self.pool.blocks_for(request.num_computed_tokens + num_new)
            return self.hybrid.reserve(request, blocks)
        needed = self.pool.blocks_for(request.num_computed_tokens + num_new) - len(
            request.block_table
        )
        if needed <= 0:  # the common decode step: room left in the last block
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False
        request.block_table.extend(blocks)
        return True

    def release(self, request: Request) -> None:
        """Every block of the request back to the pool; nothing of it counts as computed."""
        if self.hybrid is not None:
            self.hybrid.release(request)
        else:
            self.pool.free(request.block_table)
            request.block_table = []
        request.num_computed_tokens = 0

    def roll_back(self, request: Request, end: int) -> None:
        """Free the whole blocks past `end` tokens (slots of rejected proposals, or reserved
        for proposals never made); slots past num_computed_tokens in the kept last block are
        simply overwritten by the next step."""
        keep = self.pool.blocks_for(end)
        if self.hybrid is not None:
            self.hybrid.roll_back(request, keep)
        elif len(request.block_table) > keep:
            self.pool.free(request.block_table[keep:])
            del request.block_table[keep:]

    def release_outside_window(self, request: Request, computed: int) -> None:
        """Windowed models: free the blocks no query from position `computed` on can see (keys
        older than computed - window + 1), their table entries becoming the pool's null block.
        Released entries form a prefix of the table: the walk stops at the first null one.
        Safe with a step in flight (asynchronous scheduling): its queries sit at or past
        `computed`; a block reallocated meanwhile is written only by a later step."""
        if self.hybrid is not None:
            self.hybrid.release_outside_window(request, computed)
            return
        window = self.kv_window
        if window is None:
            return
        table, null = request.block_table, self.pool.null_block
        end = min(max(0, computed - window + 1) // self.pool.block_size, len(table))
        j = end - 1
        while j >= 0 and table[j] != null:
            j -= 1
        released = table[j + 1 : end]
        if released:
            self.pool.free(released)
            table[j + 1 : end] = [null] * len(released)

    def register_full_blocks(
        self, request: Request, first: int, full: int, accepted: tuple[int, ...] | None = None
    ) -> None:
        """Make blocks [first, full) findable, hashing only the ids of the blocks not hashed
        yet (a verified run's accepted ids follow the request's own)."""
        pool = self.pool
        hashes = request.block_hashes
        start, end = len(hashes) * pool.block_size, full * pool.block_size
        if start < end:
            ids = request.ids_between(start, end)
            if accepted and len(ids) < end - start:
                ids = [*ids, *accepted][: end - start]
            pool.extend_hashes(hashes, ids)
        if self.hybrid is not None:
            self.hybrid.register(request, first, full)
            return
        table = request.block_table
        for j in range(first, full):
            pool.register(table[j], hashes[j])

    def share_prompt(self, leader: Request, sample: Request) -> list[tuple[int, int]] | None:
        """n > 1: give `sample` `leader`'s computed prompt: the full prompt blocks shared (one
        more reference each), the partial last block, if any, a fresh block. Returns the
        (source, destination) block copies the caller makes (none or one), or None (nothing
        taken) without a free block, with per-kind tables, which do not share, or with a
        partial block where blocks may not be copied (tensor parallelism: the copy would
        reach rank 0's cache shard alone, the other ranks' block keeping stale K/V)."""
        bs = self.pool.block_size
        prompt_len = len(leader.prompt_ids)
        if self.hybrid is not None or (prompt_len % bs and not self.copy_blocks):
            return None
        full = prompt_len // bs
        copies = []
        table = list(leader.block_table[:full])
        if prompt_len % bs:
            fresh = self.pool.allocate(1)
            if fresh is None:
                return None
            copies.append((leader.block_table[full], fresh[0]))
            table += fresh
        self.pool.acquire(table[:full])
        sample.block_table = table
        sample.block_hashes = list(leader.block_hashes[:full])
        sample.num_computed_tokens = prompt_len
        return copies

    def all_tables(self, requests: list[Request]) -> list[list[int]]:
        """The requests' tables (every group's with per-kind tables)."""
        if self.hybrid is not None:
            return self.hybrid.all_tables(requests)
        return [r.block_table for r in requests]
