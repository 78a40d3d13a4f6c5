"""Tensor parallelism over torch.distributed: the process group (group.py), weight slicing
(shard.py), the worker loop (worker.py); expert parallelism's dispatch and combine for MoE
layers (expert_parallel.py). See docs/ARCHITECTURE.md, "Processes"."""

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
    """This rank's LlamaModel: its weight shard, its local shape, the group as its TP hooks.
    `model` is whole (its weights are cut here) or already this rank's shard, as
    load_model(shard=...) reads it."""
    from ..model.llama import LlamaModel

    config = model.config
    group.vocab_size = config.vocab_size
    ep = group.expert_parallel
    local = shard_config(config, group.rank, group.size, ep)
    if model.local is model.config:
        weights = shard_weights(model.weights, config, group.rank, group.size, ep)
    else:
        if model.local != local:
            raise TensorParallelConfigError(
                f"the model was loaded as another rank's shard ({model.local.num_heads} heads, "
                f"vocabulary {model.local.vocab_size}) than rank {group.rank} of {group.size}'s"
            )
        weights = model.weights
    return LlamaModel(
        config, weights, model.max_positions, model.kv_cache_dtype, tp=group, local=local
    )
