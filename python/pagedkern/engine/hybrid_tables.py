"""Per-kind block tables of a hybrid (local/global) model, in the scheduler's terms.

The cache's layers are split into groups (model/kv_cache.py KVLayerGroups): group 0 is a
full-attention group, whose table is Request.block_table; groups 1.. are Request.group_tables,
full or sliding. Every group's table is positional and as long as block_table; all groups draw
equal-sized blocks from the one BlockPool (what vLLM's hybrid KV cache manager does).

- Reserve: each group gets its own new blocks, taken from the pool in one allocation (all or
  none: a request never holds a partial step's blocks).
- Release: after each step a sliding group frees the blocks no future query can see (older
  than the window before the next query), their entries becoming the pool's null block. Full
  groups keep theirs. So a sliding group holds at most (window + chunk) / block_size + 2
  blocks per sequence, a decoding one about window / block_size + 1.
- Prefix caching: a block is cached under its chained hash salted with its group (equal tokens
  in two groups are two different blocks). A prefix hit of h blocks is taken only when every
  full group has blocks [0, h) cached and every sliding group has the blocks the next query's
  window reaches, [end(h), h), cached (end(h) as in the release); the longest such h is taken.
  A sliding block released while cached keeps its K/V until evicted (its hash goes with it),
  so a hit on it is valid, and one evicted is never resurrected (its key is gone).
- n > 1 forks do not share prompt blocks here (Scheduler.fork queues the sample, which
  recomputes its prompt through prefix-cache hits).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..model.config import ModelConfig
from ..model.kv_cache import KVLayerGroups, blocks_held, kv_layer_groups
from .block_pool import BlockPool
from .config import EngineConfig
from .request import Request

FULL, SLIDING = 0, 1  # the layer kinds BlockPool counts blocks in use by
KIND_NAMES = ("full", "sliding")


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of `group` holding the prefix `block_hash`."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def per_kind_groups(
    model_config: ModelConfig, config: EngineConfig, tp_size: int
) -> KVLayerGroups | None:
    """The layer groups of per-kind tables for a hybrid model, or None: one table for every
    layer (not hybrid, kv_per_kind_tables off, a draft model reading the target's tables,
    tensor parallelism, whose workers' step header knows one table)."""
    if not config.kv_per_kind_tables or config.speculative == "draft" or tp_size > 1:
        return None
    return kv_layer_groups(model_config)


class HybridTables:
    def __init__(self, pool: BlockPool, windows: Sequence[int | None], chunk: int):
        """windows: per group, its sliding window (None: full attention), group 0 full.
        chunk: the most tokens one step feeds a sequence (max_num_batched_tokens)."""
        if len(windows) < 2 or windows[0] is not None:
            raise ValueError(f"hybrid tables need a full group 0 and another group: {windows}")
        if pool.null_block is None and any(w is not None for w in windows):
            raise ValueError("sliding groups need a pool with a null block")
        self.pool = pool
        self.windows = tuple(windows)
        self.chunk = chunk
        self.num_groups = len(windows)

    def tables(self, request: Request) -> list[list[int]]:
        """The request's tables, group 0's first."""
        return [request.block_table, *request.group_tables]

    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks (all groups) a sequence of num_tokens ever holds: a sliding group
        reaches back one window from a chunk's first query; two chunks in flight under
        asynchronous scheduling (a step is scheduled before the last one's release)."""
        return blocks_held(self.windows, num_tokens, self.pool.block_size, 2 * self.chunk)

    def reserve(self, request: Request, num_blocks: int) -> bool:
        """Grow every table to num_blocks entries (False, nothing taken: too few free)."""
        needed = num_blocks - len(request.block_table)
        if needed <= 0:
            return True
        if needed * self.num_groups > self.pool.num_free:
            return False
        if len(request.group_tables) != self.num_groups - 1:  # (set at admission)
            request.group_tables = [[] for _ in range(self.num_groups - 1)]
        for window, table in zip(self.windows, self.tables(request), strict=True):
            table.extend(self.pool.allocate(needed, FULL if window is None else SLIDING))
        return True

    def release(self, request: Request) -> None:
        """Free every table. After a failed admission block_table is cleared already and the
        group tables are stale (their blocks were freed with the hits): dropped, not freed."""
        if request.block_table:
            for table in request.group_tables:
                self.pool.free(table)
            self.pool.free(request.block_table)
        request.block_table = []
        request.group_tables = []

    def release_outside_window(self, request: Request, computed: int) -> None:
        """Sliding groups: free the blocks older than the window of the query at `computed`
        (released entries form a prefix of the table: the walk stops at the first null)."""
        bs, null = self.pool.block_size, self.pool.null_block
        for window, table in zip(self.windows, self.tables(request), strict=True):
            if window is None:
                continue
            end = min(max(0, computed - window + 1) // bs, len(table))
            j = end - 1
            while j >= 0 and table[j] != null:
                j -= 1
            released = table[j + 1 : end]
            if released:
                self.pool.free(released)
                table[j + 1 : end] = [null] * len(released)

    def roll_back(self, request: Request, keep: int) -> None:
        """Free every table's entries past `keep` blocks (rejected speculative slots)."""
        for table in self.tables(request):
            if len(table) > keep:
                self.pool.free(table[keep:])
                del table[keep:]

    def register(self, request: Request, first: int, full: int) -> None:
        """Make blocks [first, full) of every group findable (hashes known up to `full`)."""
        hashes, register = request.block_hashes, self.pool.register
        for g, table in enumerate(self.tables(request)):
            for j in range(first, full):
                register(table[j], group_key(hashes[j], g))

    def prefix_hits(self, request: Request, max_blocks: int) -> tuple[list[int], int]:
        """Acquire the longest valid prefix hit (module docstring) and set the request's
        tables to it: (every block acquired, the hit's length in blocks)."""
        pool, bs, null = self.pool, self.pool.block_size, self.pool.null_block
        hashes = request.block_hashes[:max_blocks]
        h = len(hashes)
        runs: list[tuple[int, list[int]]] = []  # sliding groups: (window, cached-run lengths)
        for g, window in enumerate(self.windows):
            keys = [group_key(x, g) for x in hashes]
            if window is None:
                h = min(h, len(pool.lookup_prefix(keys, h)))
            else:
                run, length = [], 0
                for key in keys:
                    length = length + 1 if pool.cached_block(key) is not None else 0
                    run.append(length)
                runs.append((window, run))
        while h and not all(h - _window_start(h * bs, w, bs) <= run[h - 1] for w, run in runs):
            h -= 1
        tables, acquired = [], []
        for g, window in enumerate(self.windows):
            start = 0 if window is None else _window_start(h * bs, window, bs)
            ids = [pool.cached_block(group_key(x, g)) for x in hashes[start:h]]
            acquired += ids
            tables.append([null] * start + ids)
        pool.acquire(acquired)
        request.block_table, request.group_tables = tables[0], tables[1:]
        return acquired, h

    def all_tables(self, requests: Iterable[Request]) -> list[list[int]]:
        return [table for r in requests for table in self.tables(r)]


def _window_start(position: int, window: int, block_size: int) -> int:
    """The first block the window of a query at `position` reaches."""
    return max(0, position - window + 1) // block_size
