"""bitsandbytes checkpoints (`quant_method: bitsandbytes`: transformers' load_in_4bit / 8bit
saved, as the "-bnb-4bit" releases ship): each quantized linear `<x>` read from its tensors.

  4-bit (NF4 or FP4, `bnb_4bit_quant_type`):
    <x>.weight            uint8 [N K / 2, 1]  the flattened [N, K] weight's codes, two a byte,
                                              the first in the high nibble
    <x>.weight.quant_map  fp32 [16]           the code's value
    <x>.weight.absmax     fp32 [N K / B]      each block of B (blocksize) values' scale, or,
                                              double-quantized, uint8 codes of it:
    <x>.weight.nested_quant_map fp32 [256], <x>.weight.nested_absmax fp32 [blocks / B2]
    <x>.weight.quant_state.bitsandbytes__<type>  uint8: JSON (blocksize, shape, nested_blocksize,
                                              nested_offset, ...)
      absmax = nested_quant_map[absmax] nested_absmax[i // B2] + nested_offset (double-quantized)
      w = quant_map[code] absmax[i // B],  i the flattened index
  8-bit (LLM.int8()):  <x>.weight int8 [N, K], <x>.SCB fp32 [N]:  w = weight SCB / 127

A 4-bit code stands for a float from a table (no int4 grid holds it), so the weights are
dequantized in fp32 as bitsandbytes computes them and held as int8 with a scale per 32
(within 1/254 of each group's largest weight: ~3% of NF4's own step near a block's absmax,
finer elsewhere); 8-bit ones are int8 per channel with scale SCB / 127. Refused with a
ModelLoadError: a 4-bit weight without its quant state, a blocksize whose blocks do not tile.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import torch

from .errors import ModelLoadError
from .hf_quantized import Scheme, weight_from_codes
from .quantized_linear import QuantizedWeight, quantize_int8_grouped

METHOD = "bitsandbytes"
STATE = "weight.quant_state.bitsandbytes__"


def bitsandbytes_scheme(qc: Mapping, path: str) -> Scheme:
    """The mode its linears load in: 4-bit and 8-bit both as int8 (bits 8)."""
    four, eight = qc.get("load_in_4bit") is True, qc.get("load_in_8bit") is True
    if four == eight:
        raise ModelLoadError(
            path, "quantization_config: bitsandbytes needs one of load_in_4bit / load_in_8bit"
        )
    kind = qc.get("bnb_4bit_quant_type", "fp4") if four else "int8"
    if kind not in ("nf4", "fp4", "int8"):
        raise ModelLoadError(path, f"quantization_config: bnb_4bit_quant_type {kind!r}")
    return Scheme(METHOD, 8, 32, False)


def bitsandbytes_getter(
    tensor: Callable[[str], torch.Tensor | None], where: Callable[[str], str]
) -> Callable[[str], QuantizedWeight | torch.Tensor | None]:
    """get(name) for `<x>.weight` names: its QuantizedWeight, None where `<x>` is stored
    plain. A ModelLoadError names a misshapen part."""

    def get(name: str) -> QuantizedWeight | torch.Tensor | None:
        if not name.endswith(".weight"):
            return None
        stem = name.removesuffix("weight")
        try:
            for kind in ("nf4", "fp4"):
                state = tensor(stem + STATE + kind)
                if state is not None:
                    return _four_bit(stem, tensor, state)
            scb = tensor(stem + "SCB")
            return None if scb is None else _eight_bit(tensor(name), scb)
        except ValueError as exc:
            raise ModelLoadError(where(name), f"{stem[:-1]}: {exc}") from None

    return get


def _four_bit(
    stem: str, tensor: Callable[[str], torch.Tensor | None], state: torch.Tensor
) -> QuantizedWeight | torch.Tensor:
    try:
        meta = json.loads(bytes(state.to(torch.uint8).tolist()).decode("utf-8"))
        n, k = (int(v) for v in meta["shape"])
        block = int(meta["blocksize"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"its quant_state is unreadable: {exc}") from None
    packed, code = tensor(stem + "weight"), tensor(stem + "weight.quant_map")
    absmax = tensor(stem + "weight.absmax")
    if packed is None or code is None or absmax is None:
        raise ValueError("weight, weight.quant_map and weight.absmax must be beside quant_state")
    size = n * k
    packed = packed.contiguous().view(torch.uint8)  # (bnb_4bit_quant_storage: any dtype's bytes)
    if packed.numel() * 2 < size or code.numel() != 16:
        raise ValueError(f"weight {packed.dtype} {tuple(packed.shape)} packs no [{n}, {k}] codes")
    if block <= 0 or absmax.numel() != -(-size // block):
        raise ValueError(f"weight.absmax holds {absmax.numel()} scales, not one per {block}")
    if absmax.dtype == torch.uint8:  # double-quantized
        nested_code = tensor(stem + "weight.nested_quant_map")
        nested = tensor(stem + "weight.nested_absmax")
        if nested_code is None or nested is None or "nested_offset" not in meta:
            raise ValueError("a uint8 weight.absmax needs its nested_quant_map and nested_absmax")
        nested_block = int(meta.get("nested_blocksize", 256))
        at = torch.arange(absmax.numel()) // nested_block
        if nested_code.numel() != 256 or int(at[-1]) >= nested.numel():
            raise ValueError("weight.nested_absmax does not cover weight.absmax")
        absmax = nested_code.float()[absmax.long()] * nested.float()[at]
        absmax = absmax + float(meta["nested_offset"])
    flat = packed.reshape(-1)
    codes = torch.stack([flat >> 4, flat & 0x0F], dim=1).reshape(-1)[:size]
    values = code.float()[codes.long()]
    scales = absmax.float().repeat_interleave(block)[:size]
    w = (values * scales).reshape(n, k)
    return quantize_int8_grouped(w, 32) if k % 32 == 0 else w


def _eight_bit(weight: torch.Tensor | None, scb: torch.Tensor) -> QuantizedWeight | torch.Tensor:
    if weight is None or weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError("an SCB needs an int8 [N, K] weight beside it")
    if tuple(scb.shape) != (weight.shape[0],):
        raise ValueError(f"SCB {tuple(scb.shape)} is not one scale per row of {weight.shape[0]}")
    scales = (scb.float() / 127)[:, None]
    if weight.shape[1] % 32:  # (no int8 form takes it: float)
        return weight.float() * scales
    codes = weight.to(torch.int16) + 128  # (weight_from_codes requantizes a -128)
    zeros = torch.full_like(scales, 128)
    return weight_from_codes(codes, 8, scales, zeros, weight.shape[1], per_row=True)
