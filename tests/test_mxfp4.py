"""MXFP4 dequantization (model/mxfp4.py) against a quantizer written from the OCP spec
(tests/mxfp4_quantizer.py) and against transformers' own gpt-oss converter: exact values,
the nibble order and the exponent bias, shape errors."""

from __future__ import annotations

import pytest
import torch
from mxfp4_quantizer import dequantize_reference, quantize_mxfp4, representable

from pagedkern.model.mxfp4 import dequantize_mxfp4


def test_hand_built_block_nibble_order_and_bias():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21  # element 0: code 1 (0.5), element 1: code 2 (1.0)
    blocks[0, 0, 1] = 0xF9  # element 2: code 9 (-0.5), element 3: code 15 (-6.0)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128 - 127) = 2
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]
    assert not out[0, 4:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_values_dequantize_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 96, generator=g) * torch.logspace(-3, 2, 5)[:, None]  # varied scales
    exact = representable(w.double())  # on the MXFP4 grid
    blocks, scales = quantize_mxfp4(exact)
    assert blocks.shape == (3, 5, 3, 16) and scales.shape == (3, 5, 3)
    out = dequantize_mxfp4(blocks, scales, dtype)
    assert out.dtype == dtype
    assert torch.equal(out.double(), exact)  # exact in bf16 too: two significant bits
    assert torch.equal(out.double(), dequantize_reference(blocks, scales))
    assert (exact - w.double()).abs().max() <= w.abs().max() / 4 + 1e-30  # (a real rounding)


def test_equal_to_transformers_gpt_oss_converter():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (2, 6, 2), dtype=torch.uint8, generator=g)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    got = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, rows, K]
    assert torch.equal(got.transpose(1, 2), want)


def test_mismatched_shapes_and_dtypes_are_refused():
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scales \(2, 4\)"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), torch.zeros(2, 3, dtype=torch.uint8))
