"""Rank 0's side of starting tensor parallelism for an engine, and a launcher's ranks > 0."""

from __future__ import annotations

import atexit
import logging
import os
import sys

from ..processes import launched_by_launcher
from .group import TPGroup
from .shard import TensorParallelConfigError, TensorShard, check_tp_size

log = logging.getLogger("pagedkern.parallel")


def this_rank_shard(size: int, expert_parallel: bool = False) -> TensorShard:
    """The shard this process loads before the group starts: rank 0's, or the launcher's RANK
    (a torchrun rank > 0 loads its own part, then joins as a worker)."""
    rank = int(os.environ["RANK"]) if launched_by_launcher() else 0
    return TensorShard(rank, size, expert_parallel)


def start_tensor_parallel(model, config):
    """Check the split, start (or join) the group, hand the workers the model's spec, and
    return rank 0's shard of `model` (whole, or loaded as this_rank_shard's part). A process
    a launcher started as rank > 0 runs the worker loop here instead and exits when rank 0
    stops it."""
    from . import shard_model
    from .worker import serve

    size = config.tensor_parallel_size
    check_tp_size(model.config, size, config.expert_parallel)
    if config.expert_parallel and not model.config.num_experts:
        log.warning(
            "expert_parallel: %s has no experts; tensor parallelism alone", model.config.name
        )
    if config.kv_cache_dtype == "fp8":
        raise TensorParallelConfigError("kv_cache_dtype fp8 is not supported with TP > 1 yet")
    if model.device.type == "cuda" and config.num_blocks is None:
        raise TensorParallelConfigError(
            "tensor parallelism on CUDA needs num_blocks (--num-blocks) for now: the memory "
            "profiling pass runs a forward on rank 0 alone"
        )
    group = TPGroup.start(size, model.device)
    atexit.register(group.close)
    group.expert_parallel = config.expert_parallel
    # what the workers load (and whether their MoE layers hold whole experts)
    group.share_settings(
        config.model_spec().settings() | {"expert_parallel": config.expert_parallel}
    )
    sharded = shard_model(model, group)
    if group.rank != 0:
        assert launched_by_launcher()
        serve(sharded, group, config.backend)
        group.close()
        sys.exit(0)
    return sharded
