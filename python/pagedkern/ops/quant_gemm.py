"""quant_linear: x @ W.T for a weight-only quantized W (int8 per channel or per group, int4 per
group).

Dispatch after validation: CPU tensors under the "cpu" backend (and "auto") -> the CPU
backend's implementation (ops/cpu/quant_linear.py: int8-activation GEMV in C++); under
"reference" -> torch's maintained int-pack kernels
(aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu), which want bf16 activations and
bf16 scales, so x is rounded to bf16 around the GEMM and the result returned in x's dtype;
CUDA tensors -> csrc/quant_gemm.cu for decode-shaped M (<= 64, fp16/bf16 x; with the variant
quant_gemm:marlin, csrc/quant_gemm_marlin.cu for the int4 weights it takes), else (and with the
'reference' backend) the weight dequantized into a temporary half-precision workspace and
torch's GEMM. The float64 ground truth is pagedkern.reference.quant_gemm. CUDA inputs must be
torch tensors (the weight is a QuantizedWeight of torch tensors)."""

from __future__ import annotations

import torch

from ..reference.quant_gemm_marlin_layout import MarlinInt4, repack_int4, unsupported_reason
from ..reference.quantized_weight import QuantizedWeight
from . import launch, variants
from .arrays import DTYPE_CODES, view
from .cpu.int_pack import torch_int_pack_mm
from .launch import launch_context

QUANT_GEMM_MAX_M = 64  # csrc/quant_gemm.h kQuantGemmMaxM: larger M dequantizes (prefill)


def _check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
        what = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D float tensor [M, K], got {what}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}: K must equal the weight's {weight.shape[1]}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float -> [M, N] in x.dtype (accumulation in fp32 or wider), into `out` if given
    (contiguous [M, N], x's dtype and device)."""
    _check(x, weight, bias)
    if out is not None:
        shape = (x.shape[0], weight.shape[0])
        if tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(
                f"out {tuple(out.shape)} {out.dtype} must be contiguous {shape} {x.dtype}"
            )
    result = _quant_linear(x, weight, bias, out)
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def _quant_linear(x, weight, bias, out):
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    xv = view(x, "x")
    if not launch.use_reference([xv]):  # via the module: the emulator patches it there
        out = _cuda(x, weight, out)
    elif launch.host_backend([xv]) == "cpu":  # the CPU backend's (ops/cpu/quant_linear.py)
        return launch.host_ops([xv]).quant_linear(x, weight, bias)
    elif x.device.type == "cpu":
        out = torch_int_pack_mm(x, weight)
    else:
        out = _dequantized_matmul(x, weight)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


def _dequantized_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Prefill-shaped M, fp32 x or the 'reference' backend on a GPU: the weight dequantized into
    a temporary in x's half dtype (bf16 for fp32 x), then torch's GEMM (cuBLAS)."""
    dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    return x.to(dtype) @ weight.dequantize_rows(dtype=dtype).T


def _cuda(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor | None) -> torch.Tensor:
    """csrc/quant_gemm.cu for M <= 64 and half-precision x, else (and for int8 with a scale
    per group, which the kernel does not take) _dequantized_matmul."""
    m, (n, k) = x.shape[0], weight.shape
    if (
        m > QUANT_GEMM_MAX_M
        or x.dtype not in (torch.float16, torch.bfloat16)
        or weight.int8_per_group
    ):
        return _dequantized_matmul(x, weight)
    x = weight.gathered(x)  # (act-order: the stored columns' inputs)
    x = (
        x
        if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
        else x.contiguous()
    )
    xv = view(x, "x")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ov = view(out, "out")
    module, device, handle = launch_context([xv, ov])
    int4 = weight.format == "int4"
    marlin = int4 and variants.selected("quant_gemm") == "marlin" and out.data_ptr() % 8 == 0
    if marlin and unsupported_reason(weight) is None:  # pair stores: out 8-byte aligned
        _marlin(module, device, handle, x, weight, out)
        return out
    scales, mins = _half_scales(weight) if int4 else (weight.scales, None)
    module.quant_gemm(
        out=ov.ptr,
        x=xv.ptr,
        qweight=weight.qweight.data_ptr(),
        scales=scales.data_ptr(),
        mins=mins.data_ptr() if int4 else 0,
        m=m,
        n=n,
        k=k,
        x_stride=x.stride(0),
        out_stride=n,
        bits=4 if int4 else 8,
        group_size=weight.group_size if int4 else 0,
        dtype=DTYPE_CODES[xv.dtype],
        device=device,
        stream=handle,
    )
    return out


def _half_scales(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 weight's scales and mins as csrc/quant_gemm.cu reads them, fp16: its own, or
    fp16 copies of fp32 ones (GGUF Q4_K's, rounded), made once and kept in weight.packed."""
    if weight.scales.dtype == torch.float16 and weight.mins.dtype == torch.float16:
        return weight.scales, weight.mins
    half = weight.packed.get("cuda-fp16-scales")
    if half is None:
        half = weight.packed["cuda-fp16-scales"] = (
            weight.scales.half().contiguous(),
            weight.mins.half().contiguous(),
        )
    return half


def marlin_packed(weight: QuantizedWeight, dtype: torch.dtype) -> MarlinInt4:
    """The tile-ordered operands of csrc/quant_gemm_marlin.cu, built once per weight and dtype."""
    key = f"marlin-{dtype}"
    packed = weight.packed.get(key)
    if packed is None:
        packed = weight.packed[key] = repack_int4(weight, dtype)
    return packed


def marlin_k_splits(m: int, n: int, k: int, sms: int) -> int:
    """K slices for quant_gemm_marlin: enough blocks (N / 64 per slice) for four per SM, no
    more slices than 64-wide K tiles, and the fp32 partial sums (8 M N bytes per slice, written
    and read back) at most half the int4 weight's K N / 2 bytes."""
    k_tiles = k // 64
    wanted = -(-4 * sms // (n // 64))
    splits = max(1, min(wanted, k_tiles, k // (32 * m), 64))
    per_split = -(-k_tiles // splits)
    return -(-k_tiles // per_split)  # no empty slice


_marlin_counter_cache: dict[tuple[torch.device, int], torch.Tensor] = {}


def _marlin_counters(device: torch.device, stream: int, tiles: int) -> torch.Tensor:
    """The arrival counters of quant_gemm_marlin's K slices, one per 64-wide N tile: zeroed once
    (on the launch stream), left zero by every launch; one set per stream, so that launches on
    different streams never share one."""
    counters = _marlin_counter_cache.get((device, stream))
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 256), dtype=torch.int32, device=device)
        _marlin_counter_cache[device, stream] = counters
    return counters


def _marlin(module, device: int, handle: int, x, weight: QuantizedWeight, out) -> None:
    m, (n, k) = x.shape[0], weight.shape
    packed = marlin_packed(weight, x.dtype)
    splits = marlin_k_splits(m, n, k, launch.sm_count(module, device))
    views = [view(x, "x"), view(out, "out")]
    with launch.on_launch_stream(views, device, handle):  # the workspace tied to the launch
        workspace = torch.empty(splits * m * n if splits > 1 else 0, device=x.device)
        counters = _marlin_counters(x.device, handle, n // 64) if splits > 1 else None
    module.quant_gemm_marlin(
        out=out.data_ptr(),
        x=x.data_ptr(),
        qweight=packed.qweight.data_ptr(),
        scales=packed.scales.data_ptr(),
        mins=packed.mins.data_ptr(),
        workspace=workspace.data_ptr() if splits > 1 else 0,
        counters=counters.data_ptr() if splits > 1 else 0,
        m=m,
        n=n,
        k=k,
        x_stride=x.stride(0),
        out_stride=n,
        group_size=weight.group_size,
        k_splits=splits,
        dtype=DTYPE_CODES[views[0].dtype],
        device=device,
        stream=handle,
    )
