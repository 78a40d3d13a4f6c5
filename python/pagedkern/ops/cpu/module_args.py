"""How csrc/cpu/module.h takes its operands: a quantized weight as a tuple of its tile
format, addresses and shape; a tensor as its address (0: none); an activation as its code.
What the layer tail, the MoE MLP and the decoder pass, checked here once per weight."""

from __future__ import annotations

import torch

from ...reference.quantized_weight import QuantizedWeight
from . import quant_gemv

# (tile format code, tiles, scales, bias, n, k, input index): as csrc/cpu/module.h takes a weight
LinearTuple = tuple[int, int, int, int, int, int, int]


def fp32_tensor(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    """Whether t is None or a contiguous fp32 tensor of `shape` (what csrc/cpu/ reads raw)."""
    return t is None or (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.float32
        and t.is_contiguous()
        and tuple(t.shape) == shape
    )


def fp32_vector(t: torch.Tensor | None, size: int) -> bool:
    return fp32_tensor(t, (size,))


def address(t: torch.Tensor | None) -> int:
    """t's data address, 0 for None (csrc/cpu/'s null)."""
    return 0 if t is None else t.data_ptr()


def quantized_fits(w, bias: torch.Tensor | None, n: int, k: int) -> bool:
    """Whether w (and bias) is an int4/int8 [n, k] weight csrc/cpu/'s GEMV takes."""
    return (
        isinstance(w, QuantizedWeight)
        and w.format in ("int4", "int8")
        and tuple(w.shape) == (n, k)
        and k % 32 == 0
        and fp32_vector(bias, n)
    )


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # csrc/cpu/layer_tail.h's Activation
NO_LINEAR = (0, 0, 0, 0, 0, 0, 0)  # no weight (n = 0)


def linear_tuple(w: QuantizedWeight, bias: torch.Tensor | None) -> LinearTuple:
    """A quantized weight (and bias) as csrc/cpu/module.h takes it (tiles packed once)."""
    n, k = w.shape
    address = 0 if bias is None else bias.data_ptr()
    tiles = quant_gemv.packed(w)
    code = quant_gemv.tile_format_code(w)
    scales = quant_gemv.scales_address(w)
    return (code, tiles.data_ptr(), scales, address, n, k, _input_index_address(w))


def _input_index_address(w: QuantizedWeight) -> int:
    """An act-order weight's input_index as the C++ gather reads it (int64, contiguous, every
    value an input channel: checked once, kept in w.packed); 0 without one."""
    if w.input_index is None:
        return 0
    index = w.packed.get("cpu-input-index")
    if index is None:
        index, k = w.input_index.contiguous(), w.shape[1]
        if index.device.type != "cpu" or bool(((index < 0) | (index >= k)).any()):
            raise ValueError(f"input_index must hold input channels in [0, {k}) on the CPU")
        w.packed["cpu-input-index"] = index
    return index.data_ptr()
