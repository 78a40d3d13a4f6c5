"""Pre-quantized HF checkpoints: GPTQ and AWQ projections mapped exactly onto QuantizedWeight
(the int4 / int8 operand format of ops.quant_gemm), never through float weights; FP8 blocks
dequantized.

A folder's config.json says how it was quantized (`quantization_config`). Per quantized linear
`<x>` (`<x>.weight` absent), with K input and N output channels, G the group size:

  GPTQ (AutoGPTQ / GPTQModel; bits 4 or 8, p = 32 / bits codes a word):
    <x>.qweight int32 [K / p, N]   code q[k, n] at bits (k % p) * bits of word [k // p, n]
    <x>.qzeros  int32 [K / G, N / p]   zero z[g, n] at bits (n % p) * bits of word [g, n // p];
                                   checkpoint_format "gptq" (v1) stores z - 1, "gptq_v2" z
    <x>.scales  fp16 [K / G, N]
    <x>.g_idx   int32 [K]          each input channel's group (k // G unless desc_act)
  AWQ (AutoAWQ's GEMM layout, bits 4):
    <x>.qweight int32 [K, N / 8]   codes packed along N: nibble i of word [k, j] holds column
    <x>.qzeros  int32 [K / G, N / 8]   8 j + AWQ_ORDER[i]; the zeros alike
    <x>.scales  fp16 [K / G, N]
  both: w[n, k] = scales[g, n] * (q[k, n] - z[g, n]),  g = g_idx[k] (k // G but for act-order)

Act-order (GPTQ desc_act: the channels quantized in the order of their activations' size, so a
group's G channels lie anywhere along K): the input channels are sorted by group (stably) and
the weight stored in that order with `input_index` the sort (QuantizedWeight: the GEMMs gather
x by it), which makes every group contiguous again and the values the same.

As int4 (QuantizedWeight: w = scale * q + min, G 32 or 128): scale = s, min = -s z. s z has at
most 15 significant bits (an fp16 or bf16 s, as the quantizers write them, times z <= 16),
exact in fp32, so the mins are fp16 where every one is exactly an fp16, else fp32, and w comes
out bit for bit (rounding them to fp16 moved a tiny model's logits by 0.2-0.4%; the CPU
backend packs them as int4_zp tiles, z a byte, at int4's speed). A group of G = 64, 256 or the
whole row (G = -1) is its own scale repeated over groups of 32 or 128. GPTQ's 8-bit codes,
symmetric (z = 128 everywhere), are int8 codes q - 128 with the same scales.

FP8 (transformers' fine-grained FP8: Qwen3-FP8, DeepSeek; `weight_block_size` [bn, bk]):
    <x>.weight           float8_e4m3fn [N, K]
    <x>.weight_scale_inv fp32 [ceil(N / bn), ceil(K / bk)]
  w[n, k] = weight[n, k] * scale_inv[n // bn, k // bk],
  dequantized at load to fp32 (then the model's dtype): no kernel here takes fp8 weights.

compressed-tensors and bitsandbytes folders: hf_compressed_tensors.py, hf_bitsandbytes.py.
Refused with a ModelLoadError naming the key: other methods (hqq, quanto, ...: their tensors
would otherwise load as plain floats, silently wrong),
other bit widths, a g_idx whose groups are not G channels each, and asymmetric 8-bit GPTQ (no
int8 form with mins outside 0..31).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from .errors import ModelLoadError
from .quantized_linear import (
    QuantizedWeight,
    int4_from_codes,
    quantize_int8,
    quantize_int8_grouped,
)

METHODS = ("gptq", "awq", "fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset of nibble i in a word (AutoAWQ's pack)


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a checkpoint's linear weights were quantized (its quantization_config)."""

    method: str  # "gptq" | "awq" | "fp8"
    bits: int
    group_size: int  # -1: one group a row
    zeros_minus_one: bool  # GPTQ v1 stores z - 1
    block: tuple[int, int] | None = None  # fp8: the [rows, columns] a weight_scale_inv covers
    act_order: bool = False  # GPTQ desc_act: each linear's g_idx gives its groups
    # compressed-tensors: the group_size of each config group with groups (a weight's groups,
    # read off its scales' shape, must be one of them)
    group_sizes: tuple[int, ...] = ()

    @property
    def per_word(self) -> int:
        return 32 // self.bits


def scheme_of(raw: Mapping, path: str) -> Scheme | None:
    """config.json's quantization_config as a Scheme; None for an unquantized checkpoint."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ModelLoadError(path, "quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: the loader reads their _blocks / _scales (mxfp4.py)
        return None
    if method not in METHODS:
        raise ModelLoadError(
            path,
            f"quantization_config: quant_method {method!r} is not supported (supported: "
            f"{', '.join(METHODS)}, compressed-tensors, bitsandbytes, gpt-oss's mxfp4; or a GGUF "
            "file, or the unquantized checkpoint)",
        )
    if method == "fp8":
        return _fp8_scheme(qc, path)
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    for key, value in (("bits", bits), ("group_size", group)):
        if type(value) is not int:
            raise ModelLoadError(path, f"quantization_config: {key} must be an integer")
    allowed_bits = (4, 8) if method == "gptq" else (4,)
    if bits not in allowed_bits:
        raise ModelLoadError(
            path,
            f"quantization_config: {method} with bits {bits} is not supported "
            f"({' or '.join(map(str, allowed_bits))})",
        )
    if group != -1 and not (group > 0 and (group % 32 == 0 or (bits == 8 and group == 16))):
        raise ModelLoadError(
            path,
            f"quantization_config: group_size {group} is not supported (a multiple of 32, or -1)",
        )
    if method == "awq":
        if qc.get("zero_point", True) is not True:
            raise ModelLoadError(path, "quantization_config: AWQ without zero_point")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(
                path, f"quantization_config: AWQ version {version!r} (only 'gemm' is supported)"
            )
        return Scheme("awq", 4, group, False)
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))  # (GPTQModel wrote both keys)
    if "format" in qc and qc.get("checkpoint_format", fmt) != qc["format"]:
        raise ModelLoadError(path, "quantization_config: checkpoint_format and format differ")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(path, f"quantization_config: checkpoint_format {fmt!r}")
    act_order = qc.get("desc_act", False) is True and group != -1
    return Scheme("gptq", bits, group, fmt == "gptq", act_order=act_order)


def _fp8_scheme(qc: Mapping, path: str) -> Scheme:
    """transformers' fine-grained FP8 (Qwen3-FP8, DeepSeek): E4M3 weights, one fp32
    weight_scale_inv per block; activations are not quantized here (weights only)."""
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise ModelLoadError(
            path, "quantization_config: fp8 needs weight_block_size, two positive integers"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(path, f"quantization_config: fp8 fmt {qc.get('fmt')!r} (only e4m3)")
    return Scheme("fp8", 8, 0, False, (block[0], block[1]))


def quantized_getter(
    scheme: Scheme, tensor: Callable[[str], torch.Tensor | None], where: Callable[[str], str]
) -> Callable[[str], QuantizedWeight | torch.Tensor | None]:
    """get(name) for `<x>.weight` names: the QuantizedWeight of `<x>`'s packed tensors (GPTQ,
    AWQ) or its fp8 blocks dequantized to fp32; None where `<x>` is not quantized (a norm, an
    unquantized linear: the plain tensor)."""

    def get(name: str) -> QuantizedWeight | torch.Tensor | None:
        if not name.endswith(".weight"):
            return None
        stem = name.removesuffix("weight")
        if scheme.method == "fp8":  # (no scale: read as it is; fp8 there is refused)
            scale = tensor(stem + "weight_scale_inv")  # (small: read before the weight)
            if scale is None:
                return None
            try:
                return dequantize_fp8(tensor(name), scale, scheme.block)
            except ValueError as exc:
                raise ModelLoadError(where(name), f"{stem[:-1]}: {exc}") from None
        qweight = tensor(stem + "qweight")
        if qweight is None:
            return None
        parts = {
            "qweight": qweight,
            "qzeros": tensor(stem + "qzeros"),
            "scales": tensor(stem + "scales"),
            "g_idx": tensor(stem + "g_idx"),
        }
        try:
            return to_quantized_weight(scheme, **parts)
        except ValueError as exc:
            raise ModelLoadError(where(stem + "qweight"), f"{stem[:-1]}: {exc}") from None

    return get


def to_quantized_weight(
    scheme: Scheme,
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor | None,
    g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:
    """One linear's packed GPTQ / AWQ tensors as a QuantizedWeight (exactly: module docstring).
    ValueError naming the part for a missing or misshapen one."""
    for part, t in (("qzeros", qzeros), ("scales", scales)):
        if t is None:
            raise ValueError(f"{part} is missing")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(
            f"qweight and qzeros must be 2-D int32, got {qweight.dtype} {tuple(qweight.shape)} "
            f"and {qzeros.dtype}"
        )
    if not scales.dtype.is_floating_point or scales.dim() != 2:
        raise ValueError(f"scales must be a 2-D float tensor, got {scales.dtype}")
    p = scheme.per_word
    if scheme.method == "awq":
        k, n = qweight.shape[0], qweight.shape[1] * p
        codes = unpack_words(qweight, scheme.bits, AWQ_ORDER).reshape(k, n)  # [K, N]
    else:
        k, n = qweight.shape[0] * p, qweight.shape[1]
        codes = unpack_words(qweight.t(), scheme.bits).reshape(n, k).t()  # [K, N]
    groups = scales.shape[0]
    group = k if scheme.group_size == -1 else scheme.group_size
    if k % group or groups != k // group or scales.shape[1] != n:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected {(k // group, n)} for a [{n}, {k}] "
            f"weight in groups of {group}"
        )
    if qzeros.shape != (groups, n // p):
        raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, expected {(groups, n // p)}")
    order = AWQ_ORDER if scheme.method == "awq" else None
    zeros = unpack_words(qzeros, scheme.bits, order).reshape(groups, n)
    if scheme.zeros_minus_one:
        zeros = zeros + 1  # (as vLLM and AutoGPTQ read v1: a stored 15 is a zero of 16)
    order = input_order(g_idx, k, group, scheme.act_order)
    return weight_from_codes(
        codes.t(), scheme.bits, scales.t(), zeros.t(), group, order, per_row=scheme.group_size == -1
    )


def weight_from_codes(
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    order: torch.Tensor | None = None,
    per_row: bool = False,
) -> QuantizedWeight:
    """w = scales (codes - zeros) as a QuantizedWeight, exactly: codes [N, K] unsigned (0..15
    or 0..255) in the input's order, scales [N, K / group] float, zeros [N, K / group]; order:
    act-order's input_order (the columns are stored in it). 8-bit: symmetric only (zeros 128),
    one scale a row where per_row; a code of -128 (which the kernels do not take) makes the
    weight requantized per channel / per 32, within 1/254 of the largest. ValueError for K not
    a multiple of 32."""
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"{k} input channels: not a multiple of 32")
    if order is not None:
        codes = codes[:, order]
    s = scales.float().contiguous()
    if bits == 8:
        if not torch.all(zeros == 128):
            raise ValueError("asymmetric 8-bit weights (zeros other than 128) are not supported")
        q = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
        target = 16 if group == 16 else 32
        if bool((q == -128).any()):  # (compressed-tensors' range: the kernels take -127..127)
            w = q.float() * (s[:, :1] if per_row else s.repeat_interleave(group, dim=-1))
            weight = quantize_int8(w) if per_row else quantize_int8_grouped(w, target)
        elif per_row:
            weight = QuantizedWeight("int8", (n, k), q, s[:, 0].contiguous())
        else:
            weight = QuantizedWeight("int8", (n, k), q, _regroup(s, group, target), None, target)
    else:
        target = 128 if group % 128 == 0 else 32  # (group and K are multiples of 32: checked)
        mins = -(s * zeros.float())  # exact in fp32 (module docstring)
        weight = int4_from_codes(
            codes.to(torch.uint8),
            _narrowest(_regroup(s, group, target)),
            _narrowest(_regroup(mins, group, target)),
            target,
        )
    return weight if order is None else replace(weight, input_index=order, packed={})


def input_order(
    g_idx: torch.Tensor | None, k: int, group: int, act_order: bool
) -> torch.Tensor | None:
    """The input channels sorted by group (stably), where g_idx is not k // G (act-order), so
    that each group's G channels are contiguous; None where they are already. ValueError for a
    g_idx of another shape, a group out of range or a group of other than G channels."""
    if g_idx is None:
        if act_order:
            raise ValueError("g_idx is missing (desc_act: it gives each input channel's group)")
        return None
    if tuple(g_idx.shape) != (k,) or g_idx.dtype.is_floating_point:
        raise ValueError(f"g_idx must be integer [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k) // group):
        return None
    groups = k // group
    if bool(((g_idx < 0) | (g_idx >= groups)).any()) or not bool(
        (torch.bincount(g_idx, minlength=groups) == group).all()
    ):
        raise ValueError(f"g_idx does not give each of the {groups} groups {group} channels")
    return torch.sort(g_idx, stable=True).indices


def dequantize_fp8(
    weight: torch.Tensor | None, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """An E4M3 weight [N, K] times its blocks' scales [ceil(N / bn), ceil(K / bk)], in fp32 (as
    transformers and vLLM dequantize it)."""
    if weight is None or weight.dtype != torch.float8_e4m3fn:
        got = "none" if weight is None else weight.dtype
        raise ValueError(f"the weight beside weight_scale_inv must be float8_e4m3fn, got {got}")
    (n, k), (bn, bk) = weight.shape, block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want or not scale_inv.dtype.is_floating_point:
        raise ValueError(
            f"weight_scale_inv must be float {want} for a [{n}, {k}] weight in blocks of "
            f"{list(block)}, got {scale_inv.dtype} {tuple(scale_inv.shape)}"
        )
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scales


def unpack_words(
    words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """words [..., W] int32 -> codes [..., W, 32 / bits] (code i of each word at bits i * bits),
    reordered so position order[i] holds code i where `order` is given (AWQ's interleave)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (>> keeps the sign: masked)
    if order is not None:
        placed = torch.empty_like(codes)
        placed[..., list(order)] = codes
        codes = placed
    return codes.to(torch.int16)


def _regroup(per_group: torch.Tensor, group: int, target: int) -> torch.Tensor:
    """[N, K / group] values as [N, K / target] (each group's value repeated, group % target
    == 0)."""
    return per_group.repeat_interleave(group // target, dim=-1).contiguous()


def _narrowest(t: torch.Tensor) -> torch.Tensor:
    """t in fp16 where that holds every value exactly, else fp32."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t
