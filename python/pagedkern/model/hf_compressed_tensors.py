"""compressed-tensors checkpoints (llm-compressor's format: `quant_method: compressed-tensors`,
as the W4A16 / W8A16 / W8A8 / FP8 releases vLLM serves ship): each quantized linear `<x>`
read from its tensors, whichever config group quantized it.

  pack-quantized (int, 4 or 8 bits b, p = 32 / b codes a word):
    <x>.weight_packed      int32 [N, K / p]  code i of row n at bits (i % p) b of word i // p,
                                            stored as q + 2^(b-1) (q signed)
    <x>.weight_scale       float [N, K / G] (group) or [N, 1] (channel)
    <x>.weight_zero_point  int32 [N / p, K / G] (asymmetric only): packed along N the same way
    <x>.weight_shape       [N, K];  <x>.weight_g_idx int [K] (actorder "group", older exports)
      w = scale (q - zero)  =  scale (stored - stored zero)  (a symmetric zero: 2^(b-1) stored)
  int-quantized / naive-quantized (int, 8 bits):
    <x>.weight int8 [N, K], <x>.weight_scale [N, 1], [N, K / G] or one value (tensor)
  float-quantized (float, 8 bits: E4M3):
    <x>.weight float8_e4m3fn [N, K], <x>.weight_scale [N, 1], one value, [N, K / G] or blocks
      [ceil(N / bn), ceil(K / bk)] (block_structure [bn, bk])

The int forms become QuantizedWeight exactly (hf_quantized.weight_from_codes); fp8 weights are
dequantized at load, as fine-grained FP8's are. Quantized activations (W8A8's
input_activations) are not: the GEMMs take the model's float activations, which only removes
a rounding. Refused with a ModelLoadError: sparse formats, nvfp4 / mxfp* / marlin-24, other
bit widths, asymmetric int8 and float zero points.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .errors import ModelLoadError
from .hf_quantized import Scheme, dequantize_fp8, input_order, unpack_words, weight_from_codes
from .quantized_linear import QuantizedWeight

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "dense")
STRATEGIES = ("channel", "group", "tensor", "block")


def compressed_tensors_scheme(qc: Mapping, path: str) -> Scheme:
    """The folder's config groups checked (each a format, weights' type, bits and strategy
    this loader reads), as a Scheme: bits of its int weights (4 where any are 4-bit; 0 where
    all are fp8, which load dequantized), the fp8 block where a group has one."""
    if qc.get("transform_config"):  # (SpinQuant / QuIP rotations the forward would have to apply)
        raise ModelLoadError(
            path, "quantization_config: transform_config (online rotations) is not supported"
        )
    sparsity = qc.get("sparsity_config") or {}
    if isinstance(sparsity, Mapping) and sparsity.get("format", "dense") != "dense":
        raise ModelLoadError(
            path, f"quantization_config: sparse format {sparsity.get('format')!r} is not supported"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ModelLoadError(path, "quantization_config: compressed-tensors needs config_groups")
    int_bits, block, group_sizes = set(), None, set()
    for name, group in groups.items():
        where = f"quantization_config: config_groups.{name}"
        if not isinstance(group, Mapping):
            raise ModelLoadError(path, f"{where} must be a JSON object")
        fmt = group.get("format") or qc.get("format", "dense")
        if fmt == "mixed-precision":
            fmt = "dense"  # (each group names its own; none named: as the weights are stored)
        if fmt not in FORMATS:
            raise ModelLoadError(
                path, f"{where}: format {fmt!r} is not supported ({', '.join(FORMATS)})"
            )
        weights = group.get("weights")
        if weights is None:  # (activations only: the weights are plain)
            continue
        if not isinstance(weights, Mapping):
            raise ModelLoadError(path, f"{where}: weights must be a JSON object")
        kind, bits = weights.get("type", "int"), weights.get("num_bits")
        strategy = weights.get("strategy", "tensor")
        if strategy not in STRATEGIES:
            raise ModelLoadError(path, f"{where}: weights strategy {strategy!r} is not supported")
        if kind == "float":
            if bits != 8:
                raise ModelLoadError(path, f"{where}: float weights of {bits} bits (only fp8)")
            if strategy == "block":
                shape = weights.get("block_structure")
                if not (
                    isinstance(shape, list)
                    and len(shape) == 2
                    and all(type(v) is int and v > 0 for v in shape)
                ):
                    raise ModelLoadError(path, f"{where}: block weights need block_structure")
                block = (shape[0], shape[1])
        elif kind == "int":
            if bits not in (4, 8) or (bits == 4 and fmt != "pack-quantized"):
                raise ModelLoadError(path, f"{where}: int weights of {bits} bits ({fmt})")
            if strategy == "block":
                raise ModelLoadError(path, f"{where}: int weights in blocks are not supported")
            group_size = weights.get("group_size")
            if strategy == "group" and not (
                type(group_size) is int and group_size > 0 and group_size % 16 == 0
            ):
                raise ModelLoadError(path, f"{where}: group_size {group_size!r}")
            if strategy == "group":
                group_sizes.add(group_size)
            int_bits.add(bits)
        else:
            raise ModelLoadError(path, f"{where}: weights type {kind!r} is not supported")
    bits = min(int_bits) if int_bits else 0
    return Scheme(METHOD, bits, 0, False, block, group_sizes=tuple(sorted(group_sizes)))


def compressed_getter(
    scheme: Scheme, tensor: Callable[[str], torch.Tensor | None], where: Callable[[str], str]
) -> Callable[[str], QuantizedWeight | torch.Tensor | None]:
    """get(name) for `<x>.weight` names: its QuantizedWeight, or its fp8 weight dequantized;
    None where `<x>` is stored plain. A ModelLoadError names a misshapen part."""

    def get(name: str) -> QuantizedWeight | torch.Tensor | None:
        if not name.endswith(".weight"):
            return None
        stem = name.removesuffix("weight")
        try:
            return read(name, stem)
        except ValueError as exc:  # (pack-quantized holds no <x>.weight: its packed tensor's file)
            raise ModelLoadError(where(stem + "weight_scale"), f"{stem[:-1]}: {exc}") from None

    def read(name: str, stem: str) -> QuantizedWeight | torch.Tensor | None:
        packed = tensor(stem + "weight_packed")
        if packed is not None:
            parts = ("weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
            return unpack_weight(
                packed, *(tensor(stem + part) for part in parts), scheme.group_sizes
            )
        scale = tensor(stem + "weight_scale")  # (small: read before the weight)
        if scale is None:
            return None
        weight = tensor(name)
        if weight is None or not (weight.dtype == torch.int8 or weight.dtype.itemsize == 1):
            return None  # (a float weight beside its scale: stored dequantized, "frozen")
        zero = tensor(stem + "weight_zero_point")
        if zero is not None and bool(zero.ne(0).any()):
            raise ValueError("weight_zero_point: asymmetric 8-bit weights are not supported")
        if weight.dtype == torch.int8:
            return _int8_weight(weight, scale)
        return _dequantized_fp8(weight, scale, scheme.block)

    return get


def unpack_weight(
    packed: torch.Tensor,
    scale: torch.Tensor | None,
    shape: torch.Tensor | None,
    zero: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    group_sizes: tuple[int, ...] = (),
) -> QuantizedWeight:
    """A pack-quantized linear's tensors as a QuantizedWeight (module docstring). group_sizes:
    the config's (empty: not checked); a weight of several groups must be in one of them, so a
    K its group_size does not divide (ceil(K / G) groups, the last one short) is refused."""
    if scale is None or shape is None:
        raise ValueError("weight_scale and weight_shape must be beside weight_packed")
    if packed.dtype != torch.int32 or packed.dim() != 2 or shape.numel() != 2:
        raise ValueError(
            f"weight_packed must be 2-D int32 and weight_shape [N, K], got {packed.dtype} "
            f"{tuple(packed.shape)} and {tuple(shape.shape)}"
        )
    n, k = (int(v) for v in shape.tolist())
    bits = packed.shape[1] * 32 // k if k > 0 and packed.shape[0] == n else 0
    if bits not in (4, 8) or packed.shape[1] * 32 != k * bits:
        raise ValueError(f"weight_packed {tuple(packed.shape)} packs no [{n}, {k}] int4 or int8")
    if scale.numel() == 1:  # (strategy tensor: one scale)
        scale = scale.reshape(1, 1).expand(n, 1)
    elif scale.dim() == 1:
        scale = scale[:, None]
    if not scale.dtype.is_floating_point or scale.dim() != 2 or scale.shape[0] != n:
        raise ValueError(f"weight_scale must be float [{n}, groups], got {tuple(scale.shape)}")
    groups = scale.shape[1]
    group = k // groups
    if k % groups or not (group % 32 == 0 or (bits == 8 and group == 16)):
        raise ValueError(f"weight_scale's {groups} groups: {k} input channels in groups of 32s")
    if groups > 1 and group_sizes and group not in group_sizes:
        raise ValueError(
            f"{k} input channels in {groups} groups of the config's group_size "
            f"{' / '.join(map(str, group_sizes))}: a last group shorter than the others is not "
            "supported"
        )
    codes = unpack_rows(packed, bits, k)
    middle = 1 << (bits - 1)
    if zero is None:
        zeros = torch.full((n, groups), middle, dtype=torch.int16)
    elif zero.dtype != torch.int32 or tuple(zero.shape) != (-(-n * bits // 32), groups):
        raise ValueError(f"weight_zero_point {tuple(zero.shape)} packs no [{n}, {groups}] zeros")
    else:
        zeros = unpack_rows(zero.t().contiguous(), bits, n).t()  # (packed along N)
    if g_idx is not None and bool((g_idx < 0).all()):  # (older exports' "no order" fill)
        g_idx = None
    return weight_from_codes(
        codes, bits, scale, zeros, group, input_order(g_idx, k, group, False), per_row=groups == 1
    )


def unpack_rows(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """words int32 [R, length b / 32] -> the unsigned codes [R, length] (int16): code i at bits
    (i % p) b of word i // p, p = 32 / b."""
    return unpack_words(words, bits).reshape(words.shape[0], -1)[:, :length]


def _int8_weight(weight: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """int-quantized: q int8 [N, K] times a scale a row (channel, or the tensor's one), or a
    group's; regrouped as QuantizedWeight's int8 takes them."""
    n, k = weight.shape
    s = scale.float().reshape(-1, 1) if scale.dim() <= 1 else scale.float()
    if s.shape == (1, 1):
        s = s.expand(n, 1)
    codes = (weight.to(torch.int16) + 128).contiguous()
    groups = s.shape[1]
    group = k // groups
    if s.shape[0] != n or k % groups or not (group % 32 == 0 or group == 16):
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a [{n}, {k}] weight")
    zeros = torch.full((n, groups), 128, dtype=torch.int16)
    return weight_from_codes(codes, 8, s, zeros, group, per_row=groups == 1)


def _dequantized_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """float-quantized E4M3 weights times their scales, in fp32: one value, a row's ([N, 1]),
    a group's ([N, K / G]) or a block's (the scheme's block_structure)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"float-quantized weights must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape
    s = scale.float()
    if s.numel() == 1:
        return weight.float() * s.reshape(())
    if (
        block is not None
        and s.dim() == 2
        and tuple(s.shape) == (-(-n // block[0]), -(-k // block[1]))
    ):
        return dequantize_fp8(weight, s, block)
    if s.dim() == 2 and s.shape[0] == n and k % s.shape[1] == 0:
        return weight.float() * s.repeat_interleave(k // s.shape[1], dim=1)
    raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a [{n}, {k}] fp8 weight")
