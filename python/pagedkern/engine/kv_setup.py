"""The KV cache an engine runs over: how many blocks it gets (config.num_blocks, else a
profiling pass on the GPU or a fixed budget on the CPU: kv_budget.py), the context those
blocks hold, their allocation, and the block pool and scheduler that hand them out."""

from __future__ import annotations

from dataclasses import dataclass

from ..model import KVCache, KVLayerGroups, LlamaModel
from .block_pool import BlockPool
from .config import EngineConfig
from .hybrid_tables import per_kind_groups
from .kv_budget import KVCacheMemoryError, allocate_kv_cache, context_that_fits, kv_cache_blocks
from .scheduler import Scheduler, SchedulerConfig, released_kv_window


@dataclass(frozen=True, slots=True)
class KVCacheSetup:
    """An engine's KV cache, allocated, with its number of blocks, the longest sequence it
    serves and, for a hybrid local/global model, its per-kind layer groups (None: one block
    table for every layer)."""

    kv_cache: KVCache
    num_blocks: int
    max_model_len: int
    groups: KVLayerGroups | None

    @classmethod
    def allocate(
        cls,
        model: LlamaModel,
        config: EngineConfig,
        context: int,
        draft_model: LlamaModel | None = None,
    ) -> KVCacheSetup:
        """Size the cache (the draft model's weights and cache count in the budget), cap
        `context` to what it holds and allocate it. Run it under the engine's op backend: the
        profiling pass runs ops."""
        # hybrid local/global models: a block table per layer kind (engine/hybrid_tables.py)
        groups = per_kind_groups(model.config, config, model.tp.size)
        num_blocks = config.num_blocks or kv_cache_blocks(
            model, config, context, draft_model, groups
        )
        # A sequence can never outgrow the blocks requests can hold (all but the null block a
        # windowed pool reserves): one that did would be preempted forever.
        capacity = num_blocks - reserves_null_block(model, config, groups)
        max_model_len = min(context, capacity * config.block_size)
        if groups is not None:  # every group's blocks
            max_model_len = context_that_fits(
                groups, capacity, config.block_size, config.max_num_batched_tokens, context
            )
            if max_model_len < 2:
                raise KVCacheMemoryError(
                    f"{num_blocks} KV blocks hold no sequence of this model's layer groups"
                )
        if not config.enable_chunked_prefill:
            # Without chunks a sequence's prompt, or its recompute after a preemption, runs in
            # one step: a longer one would wait at the queue's head forever, and everyone
            # behind it.
            max_model_len = min(max_model_len, config.max_num_batched_tokens)
        if model.tp.size > 1:  # the workers allocate their shares of the same blocks
            model.tp.share_cache_shape(num_blocks, config.block_size)
        kv_cache = allocate_kv_cache(model, num_blocks, config.block_size, groups)
        return cls(kv_cache, num_blocks, max_model_len, groups)

    def scheduler(self, model: LlamaModel, config: EngineConfig) -> Scheduler:
        """The scheduler over a BlockPool of these blocks (Scheduler.pool); the blocks behind
        every layer's sliding window, or a sliding group's, are released as sequences grow."""
        kv_window = released_kv_window(model.config, config)
        group_windows = () if self.groups is None else self.groups.windows[1:]
        pool = BlockPool(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            reserves_null_block(model, config, self.groups),
        )
        return Scheduler(
            pool,
            SchedulerConfig.from_engine(config, self.max_model_len, kv_window, group_windows),
        )


def reserves_null_block(
    model: LlamaModel, config: EngineConfig, groups: KVLayerGroups | None
) -> bool:
    """Whether the pool keeps a null block for released table entries: every layer windowed,
    or a sliding group among per-kind tables (block_pool.py)."""
    group_windows = () if groups is None else groups.windows[1:]
    windowed = released_kv_window(model.config, config) is not None
    return windowed or any(w is not None for w in group_windows)
