"""Expert parallelism on the CPU (gloo, 2 ranks spawned here): each rank holds its expert_range of
the experts and its own tokens; its layer output (dispatch by all_to_all_single, its experts,
combine) equals ops.fused_moe over all the experts on its tokens, within fp32 summation order.
Cases: uneven token counts (one token on a rank, or none), top-k = 2 and top-k = E, a rank whose
tokens all go to the other rank's experts (it receives none and sends none to itself), 5
experts split 3 / 2, and int8 / int4 experts (stacked QuantizedWeights cut along the experts)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_experts
from pagedkern.model.tensor_shard import expert_range
from pagedkern.model.weight_shards import experts
from pagedkern.parallel.expert_parallel import expert_parallel_moe

H, I = 32, 64  # noqa: E741  (multiples of 32: int8 / int4 experts too)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(E: int):  # noqa: N803
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    down = torch.randn(E, H, I, generator=g) * I**-0.5
    return gate_up, down


CASES = [  # (experts, top_k, skew, tokens on rank 0 and 1, expert weights)
    (6, 2, True, (7, 1), "none"),
    (6, 6, False, (7, 1), "none"),
    (5, 2, False, (0, 4), "none"),
    (5, 3, True, (3, 5), "none"),
    (5, 2, False, (6, 3), "int8"),  # stacked QuantizedWeights, cut along the experts
    (6, 3, False, (2, 9), "int4"),
]


def _case(rank: int, E: int, top_k: int, skew: bool, counts, mode: str) -> None:  # noqa: N803
    gate_up, down = _weights(E)
    if mode != "none":
        gate_up, down = quantize_experts(gate_up, mode), quantize_experts(down, mode)
    g = torch.Generator().manual_seed(10 + rank)
    tokens = counts[rank]
    hidden = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    own = expert_range(E, rank, 2)
    if skew and rank == 1:  # rank 1's tokens all routed to rank 0's experts
        logits[:, own.start :] -= 100
    got = expert_parallel_moe(hidden, logits, experts(gate_up, own), experts(down, own), top_k)
    assert got.shape == (tokens, H)
    if tokens:
        want = ops.fused_moe(hidden, logits, gate_up, down, top_k)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.abs().sum() > 0


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        torch.set_num_threads(1)
        for case in CASES:  # (one pair of processes for every case: spawning costs seconds)
            _case(rank, *case)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_equals_all_experts_on_one_rank():
    mp.spawn(_rank, args=(_free_port(),), nprocs=2, join=True)
