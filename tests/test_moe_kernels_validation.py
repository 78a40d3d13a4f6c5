"""ops.moe's entries off the kernels (CPU tensors: the reference) and their argument checks: the
router's and the grouping's fallbacks return the kernels' dtypes and layouts, and each bad
argument is named in its error."""

from __future__ import annotations

import pytest
import torch

from pagedkern import reference
from pagedkern.ops import moe
from pagedkern.reference.moe import align_by_expert


def test_route_and_align_on_cpu_tensors_run_the_reference():
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.moe_route(logits, 3, scoring="sigmoid")
    want_w, want_ids = reference.moe_route(logits, 3, True, "sigmoid")
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert torch.equal(weights, want_w)
    sorted_pairs, tile_expert = moe.moe_align(ids, 12, 16)
    want = align_by_expert(ids, 12, 16)
    assert torch.equal(sorted_pairs, want[0]) and torch.equal(tile_expert, want[1])


def test_align_layout_by_hand():
    # pairs 0..5 of ids [[2, 0], [2, 1], [0, 2]]: expert 0 <- 1, 4; 1 <- 3; 2 <- 0, 2, 5
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    sorted_pairs, tile_expert = align_by_expert(ids, 4, 16)
    assert sorted_pairs.shape == (80,)  # 6 pairs + min(E, 6) * 15 = 66, in whole tiles
    assert sorted_pairs[:2].tolist() == [1, 4] and (sorted_pairs[2:16] == 6).all()
    assert sorted_pairs[16].item() == 3 and (sorted_pairs[17:32] == 6).all()
    assert sorted_pairs[32:35].tolist() == [0, 2, 5] and (sorted_pairs[35:] == 6).all()
    assert tile_expert.tolist() == [0, 1, 2, -1, -1]


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: moe.moe_route(torch.zeros(2, 4), 5), "top_k"),
        (lambda: moe.moe_route(torch.zeros(2, 4), 2, scoring="relu"), "scoring"),
        (lambda: moe.moe_route(torch.zeros(2, 4, dtype=torch.int32), 2), "router_logits"),
        (lambda: moe.moe_align(torch.zeros(2, 2), 4, 16), "ids"),
        (lambda: moe.moe_align(torch.zeros(2, 2, dtype=torch.int32), 4, 32), "tile_m"),
        (lambda: moe.moe_align(torch.zeros(2, 2, dtype=torch.int32), 0, 16), "num_experts"),
    ],
)
def test_bad_arguments_are_named(call, words):
    with pytest.raises((ValueError, TypeError), match=words):
        call()


def test_fused_moe_checks_tile_and_scoring():
    x, logits = torch.zeros(2, 8), torch.zeros(2, 4)
    gu, down = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    with pytest.raises(ValueError, match="tile_m"):
        moe.fused_moe(x, logits, gu, down, 2, tile_m=32)
    with pytest.raises(ValueError, match="scoring"):
        moe.fused_moe(x, logits, gu, down, 2, scoring="softplus")
