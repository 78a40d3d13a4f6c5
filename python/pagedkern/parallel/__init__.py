"""Tensor parallelism over torch.distributed: the process group (group.py), weight slicing
(shard.py), the worker loop (worker.py). See docs/ARCHITECTURE.md, "Processes"."""

from __future__ import annotations

from .context import SINGLE, TPContext
from .group import TensorParallelError, TPGroup
from .shard import TensorParallelConfigError, check_tp_size, shard_config, shard_weights

__all__ = [
    "SINGLE",
    "TPContext",
    "TPGroup",
    "TensorParallelConfigError",
    "TensorParallelError",
    "check_tp_size",
    "shard_config",
    "shard_model",
    "shard_weights",
]


def shard_model(model, group: TPGroup):
    """This rank's LlamaModel: its weight shard, its local shape, the group as its TP hooks."""
    from ..model.llama import LlamaModel

    config = model.config
    group.vocab_size = config.vocab_size
    local = shard_config(config, group.rank, group.size)
    weights = shard_weights(model.weights, config, group.rank, group.size)
    return LlamaModel(
        config, weights, model.max_positions, model.kv_cache_dtype, tp=group, local=local
    )
