"""Megatron-style slicing of a model's weights for one rank. The rules live in the model layer,
where the checkpoint loaders read by them (model/tensor_shard.py: which part of each tensor a
rank holds; model/weight_shards.py: the same parts cut out of weights loaded whole); this module
is parallel/'s name for them."""

from __future__ import annotations

from ..model.config import ModelConfig
from ..model.tensor_shard import TensorParallelConfigError, TensorShard, check_tp_size
from ..model.weight_shards import shard_weights

__all__ = [
    "TensorParallelConfigError",
    "TensorShard",
    "check_tp_size",
    "kv_heads_of_rank",
    "shard_config",
    "shard_weights",
]


def shard_config(
    config: ModelConfig, rank: int, size: int, expert_parallel: bool = False
) -> ModelConfig:
    """The shape one rank computes: its heads, its MLP slices, its vocabulary rows."""
    return TensorShard(rank, size, expert_parallel).config(config)


def kv_heads_of_rank(config: ModelConfig, rank: int, size: int) -> range:
    """The global KV head ids rank `rank` holds (one replicated head when they are fewer)."""
    return TensorShard(rank, size).kv_heads(config)
