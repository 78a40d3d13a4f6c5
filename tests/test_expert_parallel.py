"""Expert parallelism on the CPU (gloo, 2 ranks spawned here): each rank holds half the experts
and its own tokens; its layer output (dispatch by all_to_all_single, its experts, combine) equals
ops.fused_moe over all the experts on its tokens, within fp32 summation order. Cases: uneven
token counts (one token on a rank), top-k = 2 and top-k = E, and a rank whose tokens all go to
the other rank's experts (it receives none and sends none to itself)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkern import ops
from pagedkern.parallel.expert_parallel import expert_parallel_moe

E, H, I = 6, 32, 24  # noqa: E741


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    down = torch.randn(E, H, I, generator=g) * I**-0.5
    return gate_up, down


def _rank(rank: int, port: int, top_k: int, skew: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        torch.set_num_threads(1)
        gate_up, down = _weights()
        g = torch.Generator().manual_seed(10 + rank)
        tokens = (7, 1)[rank]
        hidden = torch.randn(tokens, H, generator=g)
        logits = torch.randn(tokens, E, generator=g)
        if skew and rank == 1:  # rank 1's tokens all routed to rank 0's experts
            logits[:, E // 2 :] -= 100
        local = slice(rank * E // 2, (rank + 1) * E // 2)
        got = expert_parallel_moe(hidden, logits, gate_up[local], down[local], top_k)
        want = ops.fused_moe(hidden, logits, gate_up, down, top_k)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.abs().sum() > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("top_k", "skew"), [(2, True), (E, False)])
def test_expert_parallel_equals_all_experts_on_one_rank(top_k, skew):
    mp.spawn(_rank, args=(_free_port(), top_k, skew), nprocs=2, join=True)
