"""The op table a model step takes on the CPU backend (ops/cpu step_implementations): every
op's CPU implementation, with quant_linear resolved once per step (its variant and the GEMM's
ISA path) computing what quant_linear computes, bit for bit, under each variant."""

from __future__ import annotations

import pytest
import torch

from pagedkern.model.quantized_linear import quantize_int4, quantize_int8
from pagedkern.ops import cpu
from pagedkern.ops.cpu import quant_linear
from pagedkern.ops.variants import use_kernels


def test_the_step_table_is_the_backends_table_but_for_quant_linear():
    table = cpu.step_implementations()
    for op, fn in cpu.IMPLEMENTATIONS.items():
        if op != "quant_linear":
            assert getattr(table, op) is fn


@pytest.mark.parametrize("variant", ["int16_activations", "int8_activations", "int_pack"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_its_quant_linear_is_quant_linear_bit_for_bit(variant, fmt):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 96, generator=g)
    weight = quantize_int8(w) if fmt == "int8" else quantize_int4(w, 32)
    x = torch.randn(5, 96, generator=g)
    bias = torch.randn(48, generator=g)
    with use_kernels(cpu_quant_linear=variant):
        step = cpu.step_implementations().quant_linear
        for rows in (x[:1], x):
            assert torch.equal(step(rows, weight), quant_linear.quant_linear(rows, weight))
        got = step(x, weight, bias)
        assert torch.equal(got, quant_linear.quant_linear(x, weight, bias))
        assert not got.isnan().any()
