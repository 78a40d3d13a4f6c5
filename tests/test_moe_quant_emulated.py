"""The quantized-experts MoE kernel (csrc/moe_gemm_quant.cu: W4A16 / W8A16 grouped GEMMs with
the activation fused into gate_up's epilogue, the routed combine) on the CPU through the
emulator (tests/emulator) against the float reference over the weights it multiplies
(moe_quant_check): odd shapes (T = 1, 3, 17, 40; E = 5, 6, 7, 60, 8; k = 1..E; H, I multiples
of 32 but not of the 64-wide tiles), both row tiles, int4 at G = 32 and 128, int8, an expert
with no token and one with all. Every buffer the op allocates starts poisoned (NaN, -7)."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from kernel_check import REL_TOLERANCE, relative_error
from moe_quant_check import expected, quantized_operands
from support.moe_buffers import poison_moe_buffers

from pagedkern.ops import moe, moe_quant

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    poison_moe_buffers(monkeypatch)


CASES = [  # tokens, experts, top_k, hidden, inter, tile_m, format, group
    (1, 8, 2, 64, 32, 16, "int4", 32),  # decode
    (3, 6, 3, 96, 64, 16, "int4", 32),  # H past one 64-wide n tile, E not a power of two
    (17, 5, 1, 128, 128, 16, "int4", 128),  # G = 128: one group over 4 K steps
    (5, 7, 7, 32, 96, 64, "int4", 32),  # k = E, the 64-row tile
    (3, 60, 8, 32, 32, 16, "int8", 0),
    (17, 6, 2, 96, 64, 64, "int8", 0),
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tile_m, fmt, group", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_experts_kernel_equals_the_reference(tokens, experts, top_k, hidden, inter,
                                                       tile_m, fmt, group, dtype):  # fmt: skip
    args = quantized_operands(tokens, experts, hidden, inter, dtype, fmt, group or 32,
                              seed=tokens * experts + hidden)  # fmt: skip
    with emulated():
        out = moe.fused_moe(*args, top_k, tile_m=tile_m)
    want = expected(*args, top_k)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_idle_experts_one_expert_takes_all_and_strided_hidden(fmt):
    x, logits, gu, down = quantized_operands(9, 8, 64, 32, torch.bfloat16, fmt, 32, seed=3)
    wide = torch.randn(9, 72).bfloat16()  # rows 144 bytes apart: copied to 16-byte rows
    wide[:, :64] = x
    logits[:, :] = -4.0
    logits[:, 6], logits[:, 2] = 4.0, 3.0  # every token to experts 6 and 2, the rest idle
    with emulated():
        out = moe.fused_moe(wide[:, :64], logits, gu, down, 2)
    want = expected(x, logits, gu, down, 2)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_options_gelu_sigmoid_no_renormalisation():
    args = quantized_operands(5, 12, 64, 32, torch.bfloat16, "int4", 32, seed=7)
    options = dict(renormalize=False, activation="gelu_tanh", scoring="sigmoid")
    with emulated():
        out = moe.fused_moe(*args, 3, **options)
    want = expected(*args, 3, **options)
    assert not torch.isnan(out).any()
    assert relative_error(out, want) <= REL_TOLERANCE[torch.bfloat16]


def test_no_tokens_launch_nothing():
    args = quantized_operands(0, 8, 32, 32, torch.bfloat16, "int4", 32, seed=0)
    with emulated(expect_launch=False):
        out = moe.fused_moe(*args, 2)
    assert out.shape == (0, 32)


def test_what_the_kernel_does_not_cover_is_refused_by_the_strict_backend():
    from pagedkern.ops.support import KernelUnsupportedError

    args = quantized_operands(2, 4, 32, 32, torch.float32, "int4", 32, seed=0)
    with emulated(expect_launch=False), pytest.raises(KernelUnsupportedError, match="float32"):
        moe.fused_moe(*args, 2)


def test_the_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    # what CUDA-graph capture forbids: a device value read by the host (the operands' one-time
    # repack included: it runs on the first call)
    args = quantized_operands(6, 8, 64, 32, torch.bfloat16, "int4", 32, seed=5)

    def refuse(*_, **__):
        raise AssertionError("a tensor's value was read on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with emulated():
        out = moe.fused_moe(*args, 2)
    with pytest.raises(AssertionError, match="read on the host"):  # the guard bites:
        moe_quant.experts_on_host(*args, 2, True, "silu", "softmax")  # (reads expert counts)
    monkeypatch.undo()
    assert relative_error(out, expected(*args, 2)) <= REL_TOLERANCE[torch.bfloat16]
