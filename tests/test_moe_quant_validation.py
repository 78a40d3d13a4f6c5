"""ops.fused_moe over quantized experts (ops/moe_quant.py) on the CPU: arguments checked with
errors naming the argument, and the host path (torch's int kernels, a loop over the experts that
received tokens) against the float MLP over the dequantized experts (reference.moe_quantized),
gpt-oss's options (expert biases, clamped SwiGLU, top-k softmax) included."""

from __future__ import annotations

import pytest
import torch
from kernel_check import relative_error
from moe_quant_check import quantized_operands

from pagedkern import ops
from pagedkern.ops.variants import use_kernels
from pagedkern.reference.moe_quantized import fused_moe_quantized

# two GEMMs on bf16 activations through torch's int kernels (quant_linear: ~0.5% each)
HOST_TOLERANCE = 3e-2


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_path_equals_the_dequantized_mlp(fmt, dtype):
    x, logits, gu, down = quantized_operands(13, 7, 64, 96, dtype, fmt, 32, seed=5)
    logits[:, 3] = 9.0  # expert 3 takes every token; some experts none
    out = ops.fused_moe(x, logits, gu, down, 3)
    want = fused_moe_quantized(x, logits, gu, down, 3)
    assert out.dtype == dtype and out.shape == (13, 64) and torch.isfinite(out).all()
    assert relative_error(out, want) <= HOST_TOLERANCE


def test_gpt_oss_options_on_the_host_path():
    x, logits, gu, down = quantized_operands(9, 8, 64, 32, torch.float32, "int4", 32, seed=6)
    g = torch.Generator().manual_seed(1)
    options = dict(
        renormalize=False, scoring="softmax_topk", activation="clamped_swiglu",
        w_gate_up_bias=torch.randn(8, 64, generator=g) * 0.5,
        w_down_bias=torch.randn(8, 64, generator=g) * 0.5, swiglu_limit=1.0,
    )  # fmt: skip
    out = ops.fused_moe(x, logits, gu, down, 4, **options)
    want = fused_moe_quantized(x, logits, gu, down, 4, **options)
    assert relative_error(out, want) <= HOST_TOLERANCE
    plain = ops.fused_moe(x, logits, gu, down, 4, renormalize=False, scoring="softmax_topk")
    assert relative_error(plain, want) > 10 * HOST_TOLERANCE  # the options are applied


def test_arguments_are_checked_and_named():
    x, logits, gu, down = quantized_operands(3, 4, 64, 32, torch.float32, "int4", 32, seed=0)
    _, _, gu8, down8 = quantized_operands(3, 4, 64, 32, torch.float32, "int8", 0, seed=0)
    with pytest.raises(ValueError, match="w_down must be stacked quantized experts"):
        ops.fused_moe(x, logits, gu, down.dequantize_rows(), 2)
    with pytest.raises(ValueError, match="w_gate_up must be stacked quantized experts"):
        ops.fused_moe(x, logits, gu.expert(0), down, 2)  # one expert's [N, K] weight
    with pytest.raises(ValueError, match=r"w_gate_up \(4, 64, 64\) must be \[E, 2I, H = 32\]"):
        ops.fused_moe(x[:, :32], logits, gu, down, 2)
    with pytest.raises(ValueError, match="w_down"):
        ops.fused_moe(x, logits, gu8, gu8, 2)
    with pytest.raises(ValueError, match="router_logits"):
        ops.fused_moe(x, logits[:, :3], gu, down, 2)
    with pytest.raises(ValueError, match="top_k"):
        ops.fused_moe(x, logits, gu, down, 5)
    with pytest.raises(ValueError, match="activation"):
        ops.fused_moe(x, logits, gu, down, 2, activation="relu")
    with pytest.raises(ValueError, match="tile_m"):
        ops.fused_moe(x, logits, gu, down, 2, tile_m=32)
    with pytest.raises(ValueError, match="w_down_bias"):
        ops.fused_moe(x, logits, gu, down, 2, w_down_bias=torch.zeros(4, 63))


@pytest.mark.parametrize("path", ["fused", "loop"])
def test_experts_of_two_forms(path):
    """int4 gate/up beside int8 down (a GGUF's Q4_K beside Q6_K): the CPU backend's call and
    the host loop give the dequantized experts' function."""
    x, logits, gu, _ = quantized_operands(5, 4, 64, 32, torch.float32, "int4", 32, seed=1)
    _, _, _, down8 = quantized_operands(5, 4, 64, 32, torch.float32, "int8", 0, seed=2)
    assert gu.kind != down8.kind
    want = ops.fused_moe(x, logits, gu.dequantize_rows(), down8.dequantize_rows(), 2)
    with use_kernels(cpu_moe=path):
        got = ops.fused_moe(x, logits, gu, down8, 2)
    assert relative_error(got, want) <= HOST_TOLERANCE
