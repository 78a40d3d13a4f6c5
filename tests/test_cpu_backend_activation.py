"""The CPU backend's silu_and_mul (ops/cpu/activation.py) against reference.silu_and_mul: the
same bits for fp32 rows of odd widths and leading shapes, the reference's own result for other
dtypes and for `out` (poisoned beforehand: every element written)."""

from __future__ import annotations

import pytest
import torch

from pagedkern import reference
from pagedkern.ops.cpu import activation


@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 1536), (2, 5, 2 * 37), (0, 8)])
def test_fp32_matches_the_reference_bit_for_bit(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 4
    before = x.clone()
    got = activation.silu_and_mul(x)
    assert torch.equal(got, reference.silu_and_mul(before))
    assert torch.equal(x, before)  # its input left as it was


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_and_out_run_the_reference(dtype):
    x = torch.randn(4, 2 * 33).to(dtype)
    assert torch.equal(activation.silu_and_mul(x), reference.silu_and_mul(x))
    out = torch.full((4, 33), float("nan"), dtype=dtype)
    assert activation.silu_and_mul(x, out) is out
    assert torch.equal(out, reference.silu_and_mul(x))
