"""Split-K in the MoE grouped GEMMs (csrc/moe_gemm_pipeline.cuh: fp32 partials per K split,
summed in split order by gate_up's reduce pass and inside the combine) on the CPU through the
emulator, float (csrc/moe_gemm.cu) and quantized (csrc/moe_gemm_quant.cu) experts, against the
reference: split factors 2..5 per GEMM, including ones that do not divide the K steps evenly and
one that leaves a split empty, T = 1, 3, 64, experts with no token, top-k = E, E not a power of
two, gpt-oss's biases (added by split 0 only). Every buffer the op allocates, the split
workspace included, starts poisoned (NaN, -7). Also the split heuristic (ops.moe.moe_split_k)
and the moe_gemm:no_split_k variant."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, launches, unavailable_reason
from kernel_check import REL_TOLERANCE, relative_error
from moe_quant_check import expected, quantized_operands
from support.moe_buffers import poison_moe_buffers
from support.moe_operands import float_operands

from pagedkern import reference
from pagedkern.ops import moe

emulator = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    poison_moe_buffers(monkeypatch)


FLOAT_CASES = [  # tokens, experts, top_k, hidden, inter, tile_m, (gate_up, down) splits
    (1, 8, 2, 168, 72, 16, (2, 3)),  # H: 6 K steps, the last partial; I: 3 steps in 3 splits
    (1, 7, 2, 168, 72, 16, (4, 2)),  # 6 steps in 4 splits: 2, 2, 2, 0 (an empty split)
    (3, 6, 6, 136, 104, 16, (5, 4)),  # k = E, E not a power of two; 5 steps in 5 splits
    (3, 60, 2, 37, 23, 16, (2, 1)),  # element loads (odd H, I), experts without tokens
    (64, 8, 2, 104, 72, 64, (3, 2)),  # T = 64, the 64-row tile; 4 steps in 3 splits: 2, 2
]


@emulator
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tile_m, splits", FLOAT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_experts_split_k_equals_the_reference(tokens, experts, top_k, hidden, inter,
                                                    tile_m, splits, dtype):  # fmt: skip
    args = float_operands(tokens, experts, hidden, inter, dtype, seed=tokens + experts + inter)
    before = launches()
    with emulated():
        out = moe.fused_moe(*args, top_k, tile_m=tile_m, split_k=splits)
    # route, align, gate_up, (its reduce pass when split), down, combine
    assert launches() - before == 5 + (splits[0] > 1)
    want = reference.fused_moe(*args, top_k)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


@emulator
@pytest.mark.parametrize("splits", [(1, 1), (3, 2)])
def test_gpt_oss_biases_and_clamped_swiglu_under_split_k(splits):
    x, logits, gu, down = float_operands(3, 5, 104, 72, torch.bfloat16, seed=4)
    g = torch.Generator().manual_seed(5)
    biases = dict(
        w_gate_up_bias=(torch.randn(5, 144, generator=g) * 0.5).bfloat16(),
        w_down_bias=(torch.randn(5, 104, generator=g) * 0.5).bfloat16(),
    )
    options = dict(renormalize=False, scoring="softmax_topk", activation="clamped_swiglu",
                   swiglu_limit=1.5, **biases)  # fmt: skip
    args = (x, logits, gu * 3, down, 2)  # gate/up past the clamp limit
    with emulated():
        out = moe.fused_moe(*args, split_k=splits, **options)
    want = reference.fused_moe(*args, **options)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


QUANT_CASES = [  # tokens, experts, top_k, hidden, inter, format, group, tile_m, splits
    (1, 8, 2, 160, 96, "int4", 32, 16, (2, 2)),  # 5 K steps in 2 splits: 3, 2; 3 in 2: 2, 1
    (3, 6, 6, 128, 128, "int4", 128, 16, (3, 4)),  # k = E; G = 128 groups across split edges
    (64, 7, 2, 160, 64, "int8", 0, 16, (4, 2)),  # T = 64, E = 7; 5 steps in 4: 2, 2, 1, 0
    (64, 5, 3, 96, 64, "int4", 32, 64, (2, 3)),  # the 64-row tile
    (3, 60, 8, 96, 64, "int8", 0, 16, (3, 1)),  # experts without tokens
]


@emulator
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, fmt, group, tile_m, splits", QUANT_CASES
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_experts_split_k_equals_the_reference(tokens, experts, top_k, hidden, inter,
                                                        fmt, group, tile_m, splits,
                                                        dtype):  # fmt: skip
    args = quantized_operands(tokens, experts, hidden, inter, dtype, fmt, group or 32,
                              seed=tokens * experts + hidden)  # fmt: skip
    before = launches()
    with emulated():
        out = moe.fused_moe(*args, top_k, tile_m=tile_m, split_k=splits)
    assert launches() - before == 5 + (splits[0] > 1)
    want = expected(*args, top_k)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


@emulator
def test_split_k_is_deterministic_and_close_to_one_split():
    args = float_operands(2, 8, 136, 72, torch.bfloat16, seed=9)
    with emulated():
        one = moe.fused_moe(*args, 2, split_k=1)
        split = moe.fused_moe(*args, 2, split_k=(3, 2))
        again = moe.fused_moe(*args, 2, split_k=(3, 2))
    assert torch.equal(split, again)
    # the same products summed in another order: equal up to a rounding of the output
    assert relative_error(split, one) <= REL_TOLERANCE[torch.bfloat16]


@emulator
def test_decode_shapes_run_the_split_path_by_default_and_the_variant_turns_it_off(kernels):
    # 1 token, top-2 of 8 over H = 512: 2 row tiles x 1 N tile, 16 K steps: splits chosen
    args = float_operands(1, 8, 512, 64, torch.bfloat16, seed=2)
    assert moe.moe_splits(1, 2, 8, 512, 64, 16, 132)[0] > 1
    before = launches()
    with emulated():
        out = moe.fused_moe(*args, 2)
    assert launches() - before == 6  # gate_up's reduce pass ran
    kernels(moe_gemm="no_split_k")
    assert moe.moe_splits(1, 2, 8, 512, 64, 16, 132) == (1, 1)
    before = launches()
    with emulated():
        plain = moe.fused_moe(*args, 2)
    assert launches() - before == 5
    want = reference.fused_moe(*args, 2)
    for got in (out, plain):
        assert not torch.isnan(got).any()
        assert relative_error(got, want) <= REL_TOLERANCE[torch.bfloat16]


def test_split_heuristic_at_qwen3_moe_shapes():
    # Qwen3-30B-A3B's experts (E = 128, k = 8, H = 2048, I = 768) on 132 SMs
    gate_up = [moe.moe_split_k(t, 8, 128, 768, 2048, 16, 132) for t in (1, 4, 16, 64)]
    down = [moe.moe_split_k(t, 8, 128, 2048, 768, 16, 132) for t in (1, 4, 16, 64)]
    assert gate_up == [6, 2, 1, 1] and down == [3, 1, 1, 1]
    # prefill fills the GPU without a split; a split never runs under SPLIT_MIN_STEPS steps
    assert moe.moe_split_k(4096, 8, 128, 768, 2048, 64, 132) == 1
    assert moe.moe_split_k(1, 2, 8, 64, 96, 16, 132) == 1  # 3 K steps
    for t in (1, 2, 3, 5, 8):
        for k in (64, 100, 768, 2048, 14336):
            s = moe.moe_split_k(t, 2, 8, 4096, k, 16, 132)
            steps = -(-k // 32)
            per = -(-steps // s)
            assert 1 <= s <= moe.SPLIT_MAX and (s - 1) * per < steps  # no empty split
            assert s == 1 or per >= moe.SPLIT_MIN_STEPS


@pytest.mark.parametrize("bad", [0, 65, (2,), (1, 0), 2.0, True, (2, "3")])
def test_a_bad_split_k_names_the_argument(bad):
    args = float_operands(1, 4, 32, 16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="split_k must be None"):
        moe.fused_moe(*args, 2, split_k=bad)
