"""MXFP4 expert weights (gpt-oss's released checkpoints), dequantized at load.

Format (OCP Microscaling, as the checkpoints and transformers' integrations/mxfp4.py read it):
`<name>_blocks` uint8 [..., rows, K/32, 16] holds two E2M1 values per byte, the low nibble
first (element 2j of a 32-block in byte j's bits 0-3, element 2j + 1 in bits 4-7); an E2M1
nibble is a sign bit and one of {0, 0.5, 1, 1.5, 2, 3, 4, 6}. `<name>_scales` uint8
[..., rows, K/32] holds each block's shared E8M0 exponent: the block's values times
2^(scale - 127). The rows are the output features (nn.Linear's orientation), so a dequantized
tensor is [..., rows, K]; transformers' parameter is its transpose ([..., K, rows]).

Dequantized at load to bfloat16 or float32 (exact in both: an E2M1 value has two significant
bits and both share float32's exponent range; magnitudes of 2^128 and up, from scales 254-255,
overflow to inf as in transformers' torch.ldexp). Not mapped onto the int4 path:
int4's affine levels (q - zero) * scale are uniformly spaced, E2M1's {0, .5, 1, 1.5, 2, 3, 4,
6} are not (spacing 0.5 below 2, then 1, then 2), so no int4 scale and zero hold a block's 16
E2M1 levels exactly; requantizing them to int4 would change the model.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 their negatives
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)
BLOCK = 32  # values per shared exponent
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[..., rows, K] in `dtype` from blocks uint8 [..., rows, K/32, 16] and scales uint8
    [..., rows, K/32]. ValueError (naming the shapes) if they do not pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} must be [..., K/32, 16] with scales "
            f"{tuple(scales.shape)} = blocks' shape without its last dimension"
        )
    # in float32 (exact), then one conversion (exact in bf16 too but at the range's ends)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1)
    values = values.flatten(-2)  # [..., K/32, 32]: low nibble first
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1).float()
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)
