"""The MoE kernels (csrc/moe_route.cu, csrc/moe_gemm.cu) on the CPU through the emulator
(tests/emulator; the grouped GEMM's mma.sync runs as mma_fragments.cuh's warp-shuffle
spelling) against the reference: the router's ids exactly (ties included), the grouping's
layout exactly and its invariants on their own, the whole layer over odd shapes (T = 1, 3, 17;
E = 8, 60; k = 1, 2, 8; H and I not multiples of the tiles, both row tiles, both load paths).
Every buffer the op allocates (outputs and workspaces) starts poisoned: NaN for floats, -7 for
ints, so a row the kernels forget to write, or read before it is written, fails."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from kernel_check import REL_TOLERANCE, relative_error
from support.moe_buffers import poison_moe_buffers
from support.moe_operands import float_operands

from pagedkern import reference
from pagedkern.ops import moe
from pagedkern.reference.moe import align_by_expert, padded_rows

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    poison_moe_buffers(monkeypatch)


def _logits(tokens, experts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts, generator=g) * 3).to(dtype)
    if tokens >= 3:
        logits[0] = 0.5  # every expert tied: ids 0..k-1
        logits[1, ::2] = float("-inf")  # -inf experts, tied with each other
        logits[2] = torch.randint(0, 3, (experts,), generator=g).to(dtype)  # many ties
    return logits


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("experts, top_k", [(8, 1), (8, 2), (8, 8), (60, 2), (60, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_ids_equal_the_reference_and_weights_agree(tokens, experts, top_k, dtype):
    logits = _logits(tokens, experts, dtype, seed=tokens * 100 + experts + top_k)
    for scoring, renormalize in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        with emulated():
            weights, ids = moe.moe_route(logits, top_k, renormalize=renormalize, scoring=scoring)
        want_w, want_ids = reference.moe_route(logits, top_k, renormalize, scoring)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids.long(), want_ids), (scoring, ids, want_ids)
        assert not torch.isnan(weights).any()
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)


def test_router_tie_rule_is_lower_id_first():
    # the rule itself, not only agreement: equal logits go to the lower expert id, in order
    logits = torch.tensor([[1.0, 3.0, 3.0, 1.0, 3.0, 0.0, 1.0, 1.0]])
    with emulated():
        _, ids = moe.moe_route(logits, 5)
    assert ids.tolist() == [[1, 2, 4, 0, 3]]


def _ids(tokens, experts, top_k, seed, skew=False):
    """Distinct experts per token; skew: expert 0 in every token's first slot and experts
    1..k-1 in the rest, so one expert takes every token and E - k experts get none."""
    g = torch.Generator().manual_seed(seed)
    if skew:
        return torch.arange(top_k).repeat(tokens, 1).int()
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()


@pytest.mark.parametrize("tokens", [1, 3, 17, 300])
@pytest.mark.parametrize("experts, top_k", [(8, 1), (8, 2), (60, 8), (5, 5)])
@pytest.mark.parametrize("tile_m", [16, 64])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "one-expert-takes-all"])
def test_grouping_layout_and_invariants(tokens, experts, top_k, tile_m, skew):
    ids = _ids(tokens, experts, top_k, seed=tokens + experts + tile_m, skew=skew)
    with emulated():
        sorted_pairs, tile_expert = moe.moe_align(ids, experts, tile_m)
    pairs = tokens * top_k
    rows = padded_rows(pairs, experts, tile_m)
    assert sorted_pairs.shape == (rows,) and tile_expert.shape == (rows // tile_m,)
    # invariants, checked without the reference:
    real = sorted_pairs[sorted_pairs != pairs]
    assert sorted(real.tolist()) == list(range(pairs)), "each pair exactly once, no poison"
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=experts)
    used_tiles = int(((counts + tile_m - 1) // tile_m).sum())
    assert (tile_expert[:used_tiles] >= 0).all() and (tile_expert[used_tiles:] == -1).all()
    assert (sorted_pairs[used_tiles * tile_m :] == pairs).all()
    tiles = sorted_pairs[: used_tiles * tile_m].reshape(used_tiles, tile_m).long()
    for tile, expert in zip(tiles, tile_expert[:used_tiles].tolist(), strict=True):
        members = tile[tile != pairs]
        assert len(members) > 0 and (flat[members] == expert).all()
        assert torch.equal(members, members.sort().values), "stable: pair order within expert"
    assert tile_expert[:used_tiles].tolist() == sorted(tile_expert[:used_tiles].tolist())
    # and element for element the reference's layout
    want = align_by_expert(ids, experts, tile_m)
    assert torch.equal(sorted_pairs, want[0]) and torch.equal(tile_expert, want[1])


CASES = [  # tokens, experts, top_k, hidden, inter, tile_m
    (1, 8, 2, 72, 40, 16),  # decode; H, I multiples of 8 (16-byte loads), not of the tiles
    (3, 60, 8, 40, 24, 16),
    (17, 8, 1, 72, 136, 16),  # I past two n tiles
    (17, 60, 2, 37, 23, 16),  # odd H and I: element loads
    (17, 8, 8, 48, 40, 64),  # k = E, the 64-row tile
    (3, 8, 2, 37, 23, 64),
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tile_m", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_kernel_equals_the_reference(tokens, experts, top_k, hidden, inter, tile_m,
                                               dtype):  # fmt: skip
    args = float_operands(tokens, experts, hidden, inter, dtype, seed=tokens * experts + hidden)
    with emulated():
        out = moe.fused_moe(*args, top_k, tile_m=tile_m)
    want = reference.fused_moe(*args, top_k)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


@pytest.mark.parametrize("activation, scoring, renormalize",
                         [("gelu_tanh", "softmax", False), ("silu", "sigmoid", True)])  # fmt: skip
def test_fused_moe_options(activation, scoring, renormalize):
    args = float_operands(5, 12, 40, 24, torch.bfloat16, seed=7)
    kwargs = dict(renormalize=renormalize, activation=activation, scoring=scoring)
    with emulated():
        out = moe.fused_moe(*args, 3, **kwargs)
    want = reference.fused_moe(*args, 3, renormalize, activation, scoring)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_fused_moe_strided_hidden_and_experts_without_tokens():
    x, logits, gu, down = float_operands(9, 8, 48, 24, torch.bfloat16, seed=3)
    wide = torch.randn(9, 64).bfloat16()
    wide[:, :48] = x
    logits[:, :] = -4.0
    logits[:, 6], logits[:, 2] = 4.0, 3.0  # every token to experts 6 and 2, the rest idle
    with emulated():
        out = moe.fused_moe(wide[:, :48], logits, gu, down, 2)
    want = reference.fused_moe(x, logits, gu, down, 2)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_fused_moe_with_no_tokens():
    x, logits, gu, down = float_operands(0, 8, 16, 8, torch.bfloat16, seed=0)
    with emulated(expect_launch=False):
        out = moe.fused_moe(x, logits, gu, down, 2)
    assert out.shape == (0, 16)


def test_fp32_experts_are_refused_by_the_strict_backend():
    from pagedkern.ops.support import KernelUnsupportedError

    args = float_operands(2, 4, 16, 8, torch.float32, seed=0)
    with emulated(expect_launch=False), pytest.raises(KernelUnsupportedError, match="float32"):
        moe.fused_moe(*args, 2)


def test_the_row_bound_is_one_formula():
    from emulator import load

    module = load()
    cases = [(0, 8, 16), (1, 8, 16), (16, 8, 64), (136, 60, 16), (9, 512, 64)]
    for pairs, experts, tile_m in cases:
        want = padded_rows(pairs, experts, tile_m)
        assert module.moe_padded_rows(pairs=pairs, experts=experts, tile_m=tile_m) == want


def test_fused_moe_chooses_the_64_row_tile_at_prefill_shapes():
    # 40 tokens x top-4 over 4 experts: 40 rows per expert on average, past 32
    assert moe.moe_tile_m(40, 4, 4) == 64 and moe.moe_tile_m(3, 4, 8) == 16
    args = float_operands(40, 4, 40, 24, torch.float16, seed=11)
    with emulated():
        out = moe.fused_moe(*args, 4)
    want = reference.fused_moe(*args, 4)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.float16]


def test_the_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    # what CUDA-graph capture forbids: a device value read by the host (all sizes come from
    # the shapes); every way a tensor's value reaches Python raises here
    args = float_operands(6, 8, 40, 24, torch.bfloat16, seed=5)

    def refuse(*_, **__):
        raise AssertionError("a tensor's value was read on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with emulated():
        out = moe.fused_moe(*args, 2)
    with pytest.raises(AssertionError, match="read on the host"):  # the guard bites:
        reference.fused_moe(*args, 2)  # the reference reads the expert counts
    monkeypatch.undo()
    assert relative_error(out, reference.fused_moe(*args, 2)) <= REL_TOLERANCE[torch.bfloat16]
