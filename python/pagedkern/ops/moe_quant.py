"""fused_moe over weight-only quantized experts: w_gate_up and w_down as stacked QuantizedWeights
([E, 2I, H] and [E, H, I], both int4 with one group size, or both int8; ops.fused_moe hands
them here). Validation, then

  CUDA tensors: csrc/moe_route.cu and csrc/moe_gemm_quant.cu (W4A16 / W8A16 grouped GEMMs over
      the QuantizedWeight codes, the int4 scales repacked once per weight and dtype:
      kernel_operands; ops.moe's split-K choice), five or six launches on the caller's stream,
      no host synchronisation;
  CPU tensors on the CPU backend: one C++ call a layer where it fits (ops/cpu/moe_quant.py);
  otherwise (the reference backend, what neither covers): the tokens grouped by expert with one
      sort and a loop over the experts that received tokens, each expert's GEMMs through
      quant_linear (the dense layers' own; on a GPU its kernels).

The float64 ground truth is reference.fused_moe over the dequantized experts
(reference.moe_quantized)."""

from __future__ import annotations

from types import ModuleType

import torch

from ..reference.moe import ACTIVATIONS, group_by_expert
from ..reference.moe import moe_route as route_reference
from ..reference.quantized_weight import QuantizedWeight
from . import support
from .arrays import DTYPE_CODES, check_dtype, check_ndim, check_shape, view
from .launch import host_backend, kernel_or_reference, launch_context
from .quant_gemm import quant_linear


def check_experts(hidden, router_logits, w_gate_up, w_down, top_k: int) -> tuple[int, int, int]:
    """(E, H, I) of quantized experts, after checking them against hidden [T, H] and the router
    logits [T, E]; errors name the argument, its format and shape."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, QuantizedWeight) or w.num_experts is None:
            what = f"{w.format} {tuple(w.shape)}" if isinstance(w, QuantizedWeight) else type(w)
            raise ValueError(
                f"{name} must be stacked quantized experts (QuantizedWeight [E, N, K]) like the "
                f"other expert weight, got {what}"
            )
    hv, rv = view(hidden, "hidden"), view(router_logits, "router_logits")
    check_dtype(hv, ("float16", "bfloat16", "float32"))
    check_ndim(hv, 2)
    tokens, h = hv.shape
    experts, two_i, k = w_gate_up.shape
    if two_i % 2 or k != h:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} must be [E, 2I, H = {h}]")
    inter = two_i // 2
    if tuple(w_down.shape) != (experts, h, inter):
        raise ValueError(f"w_down {tuple(w_down.shape)} must be [E, H, I] = {(experts, h, inter)}")
    check_shape(rv, (tokens, experts))
    if not 1 <= top_k <= experts or isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int in [1, {experts}] (the experts), got {top_k!r}")
    devices = {hidden.device, router_logits.device, w_gate_up.device, w_down.device}
    if len(devices) > 1:
        raise ValueError(f"hidden, router_logits and the experts must share a device: {devices}")
    return experts, h, inter


def fused_moe_quantized(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: QuantizedWeight,
    w_down: QuantizedWeight,
    top_k: int,
    *,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    tile_m: int | None = None,
    split_k: int | tuple[int, int] | None = None,
    stream=None,
    routing: ModuleType,
) -> torch.Tensor:
    """ops.fused_moe for quantized experts (same arguments and result; the expert biases and
    the clamped SwiGLU run on the host path). routing: ops.moe, which calls this (its option
    names, the row tile's choice and the router and grouping launches; passed in, so neither
    module imports the other in a cycle)."""
    experts, h, inter = check_experts(hidden, router_logits, w_gate_up, w_down, top_k)
    for name, value, allowed in (
        ("activation", activation, routing.MOE_ACTIVATIONS),
        ("scoring", scoring, routing.MOE_SCORINGS),
        ("tile_m", tile_m, (*routing.MOE_TILES, None)),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    forced_splits = routing.check_split_k(split_k)
    hv, rv = view(hidden, "hidden"), view(router_logits, "router_logits")
    codes = [view(w.qweight, name) for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down))]
    fmt, group = w_gate_up.format, w_gate_up.group_size
    biases = (w_gate_up_bias, w_down_bias)
    for name, b, rows in (("w_gate_up_bias", biases[0], 2 * inter), ("w_down_bias", biases[1], h)):
        if b is not None and (tuple(b.shape) != (experts, rows) or b.device != hidden.device):
            raise ValueError(
                f"{name} {tuple(b.shape)} must be [{experts}, {rows}] on {hidden.device}"
            )
    can = support.fused_moe_quantized(hv.dtype, experts, fmt, group, h, inter, activation)
    if can.supported and (any(b is not None for b in biases) or scoring == "softmax_topk"):
        can = support.KernelSupport(False, "gpt-oss's biases or routing over quantized experts")
    if can.supported and w_gate_up.kind != w_down.kind:  # (the loader gives CUDA one form)
        can = support.KernelSupport(False, "gate/up and down experts of two forms")
    if not kernel_or_reference("fused_moe", [hv, rv, *codes], can):
        if host_backend([hv, rv, *codes]) == "cpu":  # the CPU backend's one C++ call
            from .cpu import moe_quant as cpu_moe

            if cpu_moe.applies(hidden, w_gate_up, w_down, activation, biases):
                return cpu_moe.fused_moe_quantized(
                    hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation,
                    scoring, biases,
                )  # fmt: skip
        swiglu = (swiglu_alpha, swiglu_limit)
        return experts_on_host(hidden, router_logits, w_gate_up, w_down, top_k, renormalize,
                               activation, scoring, biases, swiglu)  # fmt: skip
    tokens = hv.shape[0]
    tile = tile_m or routing.moe_tile_m(tokens, top_k, experts)
    if hidden.stride(1) != 1 or hidden.stride(0) % 8 or hidden.data_ptr() % 16:
        hidden = hidden.contiguous()  # the kernel stages 16-byte rows
        if hidden.data_ptr() % 16:
            hidden = hidden.clone()
    return _launch(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation,
                   scoring, tile, forced_splits, stream, routing)  # fmt: skip


def experts_on_host(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation,
                    scoring, biases=(None, None), swiglu=(1.702, 7.0)) -> torch.Tensor:  # fmt: skip
    """The quantized experts without the MoE kernels: tokens grouped by expert with one sort,
    a loop over the experts that received tokens (a host sync: not capturable), each GEMM by
    quant_linear with the reference's roundings (gate_up and each expert's output in hidden's
    dtype, the activation in fp32, the weighted sum in fp32 rounded once)."""
    tokens = hidden.shape[0]
    inter = w_down.shape[-1]
    weights, ids = route_reference(router_logits, top_k, renormalize, scoring)
    order, counts = group_by_expert(ids, w_gate_up.shape[0])
    token_of = order // top_k
    x = hidden[token_of]  # [T*k, H], grouped by expert
    pair_weights = weights.reshape(-1)[order]
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        bias = [None if b is None else b[e] for b in biases]
        gate_up = quant_linear(x[rows], w_gate_up.expert(e), bias[0]).float()
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if activation == "clamped_swiglu":
            from ..reference.moe import clamped_swiglu

            h = clamped_swiglu(gate, up, *swiglu).to(hidden.dtype)
        else:
            h = (ACTIVATIONS[activation](gate) * up).to(hidden.dtype)
        y = quant_linear(h, w_down.expert(e), bias[1]).float()
        out.index_add_(0, token_of[rows], y * pair_weights[rows, None])
        start += n
    return out.to(hidden.dtype)


def kernel_operands(
    weight: QuantizedWeight, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) as csrc/moe_quant.h takes them, built once per weight and dtype: int4:
    the codes as they are, the (scale, min) pairs in `dtype` as int32 [E, K/G, N]; int8: the
    codes and the fp32 channel scales as they are. Copies where a part is not aligned."""
    key = f"moe-{dtype}"
    packed = weight.packed.get(key)
    if packed is None:
        codes = weight.qweight.contiguous()
        if codes.data_ptr() % 16:  # (e.g. a view into a safetensors file)
            codes = codes.clone()
        if weight.format == "int4":
            pairs = torch.stack([weight.scales.to(dtype), weight.mins.to(dtype)], dim=-1)
            scales = pairs.permute(0, 2, 1, 3).contiguous().view(torch.int32)[..., 0]
        else:
            scales = weight.scales.float().contiguous()
            if scales.data_ptr() % 4:
                scales = scales.clone()
        packed = weight.packed[key] = (codes, scales)
    return packed


def _launch(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation, scoring,
            tile, forced_splits, stream, routing: ModuleType) -> torch.Tensor:  # fmt: skip
    hv, rv = view(hidden, "hidden"), view(router_logits, "router_logits")
    tokens, h = hv.shape
    experts, inter = w_gate_up.shape[0], w_down.shape[-1]
    gate_up_q, gate_up_s = kernel_operands(w_gate_up, hidden.dtype)
    down_q, down_s = kernel_operands(w_down, hidden.dtype)
    views = (hv, rv)
    module, device, handle = launch_context(views, stream)
    wv, sorted_pairs, tile_expert, h_buf, y_buf, out = routing.routed_buffers(
        module, device, handle, views, hv, rv, top_k, experts, inter, tile, renormalize, scoring
    )
    h_rows = sorted_pairs.shape[0]
    splits = forced_splits or routing.moe_splits(tokens, top_k, experts, h, inter, tile,
                                                 routing.sm_count(module, device))  # fmt: skip
    workspace = routing.split_workspace(views, device, handle, hv, splits, h_rows, top_k, inter)
    module.moe_experts_quant(
        out=view(out, "out").ptr,
        h=view(h_buf, "h").ptr,
        y=view(y_buf, "y").ptr,
        hidden=hidden.data_ptr(),
        gate_up_q=gate_up_q.data_ptr(),
        gate_up_scales=gate_up_s.data_ptr(),
        down_q=down_q.data_ptr(),
        down_scales=down_s.data_ptr(),
        weights=wv.ptr,
        sorted_pairs=view(sorted_pairs, "sorted_pairs").ptr,
        tile_expert=view(tile_expert, "tile_expert").ptr,
        tokens=tokens,
        hidden_size=h,
        inter_size=inter,
        hidden_stride=hidden.stride(0),
        out_stride=h,
        padded_rows=h_rows,
        experts=experts,
        top_k=top_k,
        tile_m=tile,
        activation=routing.MOE_ACTIVATIONS.index(activation),
        bits=4 if w_gate_up.format == "int4" else 8,
        group_size=w_gate_up.group_size,
        dtype=DTYPE_CODES[hv.dtype],
        device=device,
        stream=handle,
        workspace=0 if workspace is None else workspace.data_ptr(),
        gate_up_splits=splits[0],
        down_splits=splits[1],
    )
    return out
