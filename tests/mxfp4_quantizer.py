"""A tiny MXFP4 quantizer for tests, written from the OCP Microscaling spec (MXFP4: blocks of
32 E2M1 values sharing one E8M0 exponent, bias 127) in the byte layout of gpt-oss's
checkpoints (two values per byte, the lower-indexed one in the low nibble; see
pagedkern/model/mxfp4.py), independent of the loader's dequantizer."""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _block_exponents(w: torch.Tensor) -> torch.Tensor:
    """Per block of 32 (last dimension): the shared exponent e with max |w| / 2^e <= 6
    (E2M1's largest magnitude), as OCP's floor(log2(amax)) - 2 (emax of E2M1)."""
    amax = w.abs().amax(-1)
    e = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2
    return e.clamp(-127, 127)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) of w [..., K] (K % 32 == 0):
    each value the nearest E2M1 level (ties to the lower magnitude) times its block's 2^e."""
    blocks = w.double().unflatten(-1, (-1, 32))
    e = _block_exponents(blocks)
    scaled = blocks / torch.pow(2.0, e).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)  # first = lower
    codes = codes | ((scaled < 0).long() << 3)  # sign bit (bit 3 of the nibble)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2j low nibble, 2j+1 high
    return packed.to(torch.uint8), (e + 127).to(torch.uint8)


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., K] of quantize_mxfp4's output, by the spec's formula."""
    low, high = (blocks & 0x0F).long(), (blocks >> 4).long()
    codes = torch.stack([low, high], -1).flatten(-2)  # [..., K/32, 32]
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    magnitude = E2M1_MAGNITUDES[codes & 7]
    scale = torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return (sign * magnitude * scale).flatten(-2)


def representable(w: torch.Tensor) -> torch.Tensor:
    """w rounded onto the MXFP4 grid (what a round trip through MXFP4 gives), in w's dtype."""
    return dequantize_reference(*quantize_mxfp4(w)).to(w.dtype)
