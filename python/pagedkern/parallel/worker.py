"""A tensor-parallel worker (rank 1..N-1): join the group, load and shard the model rank 0
names, allocate this rank's share of the KV cache, then per step: receive the header and the
packed batch, run the forward shard (its all-reduces and the LM head gather to rank 0), repeat
until rank 0 says stop or goes away.

    python -m pagedkern.parallel.worker     (spawned by rank 0, or started by torchrun)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from .. import ops
from ..processes import die_with_parent, launched_by_launcher
from .group import SEND_KV, STOP, TPGroup

log = logging.getLogger("pagedkern.parallel.worker")


def serve(model, group: TPGroup, backend: str) -> None:
    """The step loop of a worker whose sharded model is loaded."""
    num_blocks, block_size = group.share_cache_shape()
    kv_cache = model.allocate_kv_cache(num_blocks, block_size)
    with ops.use_backend(backend), torch.inference_mode():
        while (header := group.receive_header())[0] != STOP:
            if header[0] == SEND_KV:
                group.send_kv_cache(kv_cache.data)
                continue
            input_ids, meta, logits = group.receive_batch(header)
            if logits:
                model(input_ids, meta, kv_cache)  # the gather sends this rank's logits
            else:
                model.hidden_states(input_ids, meta, kv_cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a tensor-parallel worker (spawned by rank 0)")
    parser.add_argument("--device", default="cpu", help="rank 0's device type: cpu or cuda")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it exits")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    die_with_parent(args.parent_pid)
    if not launched_by_launcher():
        print("pagedkern.parallel.worker: RANK/WORLD_SIZE/MASTER_* are not set", file=sys.stderr)
        return 2
    from ..model.spec import ModelSpec
    from . import shard_model
    from .shard import TensorShard

    group = TPGroup.start(int(os.environ["WORLD_SIZE"]), torch.device(args.device))
    try:
        settings = group.share_settings(None)
        group.expert_parallel = settings.pop("expert_parallel", False)
        spec = ModelSpec(**settings)
        shard = TensorShard(group.rank, group.size, group.expert_parallel)
        model, _ = spec.load(group.device, shard)  # its part only
        serve(shard_model(model, group), group, spec.backend)
    finally:
        # Leave the group (join gloo's threads) before the interpreter finalizes: a gloo thread
        # still dropping the last broadcast's tensors needs the GIL, and a thread that asks for
        # it during finalization is ended mid C++ destructor, which aborts the process.
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
