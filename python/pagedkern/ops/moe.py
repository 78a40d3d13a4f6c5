"""fused_moe: the mixture-of-experts MLP (router top-k, tokens grouped by expert, each expert's
gated MLP, the weighted combine), and its first two stages as ops of their own (moe_route,
moe_align). Validation here, then csrc/moe_route.cu and csrc/moe_gemm.cu (five launches on the
caller's stream, six with gate_up's K split; every size, the splits included, fixed by the
shapes: no host synchronisation, so a decode step can be captured in a CUDA graph) or the
PyTorch reference (reference/moe.py, which reads the expert counts back to the host)."""

from __future__ import annotations

import math
import sys

from . import moe_sm90, support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_same_dtype,
    check_shape,
    empty_like,
    rows_of,
    view,
)
from .launch import (
    kernel_or_reference,
    kernel_variant,
    launch_context,
    on_launch_stream,
    reference_on_torch,
    sm_count,
)

# csrc/silu_and_mul.h GatedActivation order, then gpt-oss's clamped SwiGLU (moe.h)
MOE_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
MOE_SCORINGS = ("softmax", "sigmoid", "softmax_topk")  # csrc/moe.h MoeScoring order
MOE_TILES = (16, 64)  # the grouped GEMM's row tiles


MOE_MAX_SPLITS = 64  # csrc/moe.h kMoeMaxSplits
MOE_STEP_K = 32  # the grouped GEMMs' K step (moe_gemm_pipeline.cuh kBK)
MOE_TILE_N = 64  # ... and N tile (kBN)
SPLIT_BLOCKS_PER_SM = 4  # blocks a split-K grid aims for per SM (4 warps each)
SPLIT_MAX = 16  # splits moe_split_k chooses at most
SPLIT_MIN_STEPS = 4  # K steps each split keeps at least (a pipeline's depth)


def moe_split_k(tokens: int, top_k: int, experts: int, n: int, k: int, tile_m: int,
                sms: int) -> int:  # fmt: skip
    """K splits for one grouped GEMM of N output columns over K: at decode the blocks (row
    tiles x N tiles) under-fill the SMs while each streams a long K of weights. The row tiles
    are estimated from the shapes alone (no host sync): the experts T tokens are expected to
    reach under uniform routing, or T*k / tile_m if more. Enough splits for
    SPLIT_BLOCKS_PER_SM blocks per SM, at most SPLIT_MAX, each of SPLIT_MIN_STEPS K steps or
    more, none empty; 1 once the grid fills the GPU (prefill)."""
    pairs = tokens * top_k
    if pairs == 0:
        return 1
    reached = experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    blocks = max(reached, pairs / tile_m) * -(-n // MOE_TILE_N)
    target = SPLIT_BLOCKS_PER_SM * sms
    if blocks >= target:
        return 1
    steps = -(-k // MOE_STEP_K)
    splits = max(1, min(math.ceil(target / blocks), SPLIT_MAX, steps // SPLIT_MIN_STEPS))
    per_split = -(-steps // splits)
    return -(-steps // per_split)  # no empty split


def moe_splits(tokens: int, top_k: int, experts: int, hidden: int, inter: int, tile_m: int,
               sms: int) -> tuple[int, int]:  # fmt: skip
    """(gate_up splits, down splits) the kernels run: moe_split_k's for gate_up (N = I, K = H)
    and down (N = H, K = I), or (1, 1) under the variant moe_gemm:no_split_k."""
    if kernel_variant("moe_gemm") == 1:  # no_split_k
        return 1, 1
    return (moe_split_k(tokens, top_k, experts, inter, hidden, tile_m, sms),
            moe_split_k(tokens, top_k, experts, hidden, inter, tile_m, sms))  # fmt: skip


def check_split_k(split_k) -> tuple[int, int] | None:
    if split_k is None:
        return None
    pair = split_k if isinstance(split_k, tuple) else (split_k, split_k)

    def bad(s) -> bool:
        return isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MOE_MAX_SPLITS

    if len(pair) != 2 or any(bad(s) for s in pair):
        raise ValueError(
            f"split_k must be None, an int in [1, {MOE_MAX_SPLITS}] or a (gate_up, down) pair "
            f"of them, got {split_k!r}"
        )
    return pair


def moe_tile_m(tokens: int, top_k: int, experts: int) -> int:
    """The grouped GEMM's row tile: 64 once an expert receives 32 rows on average (prefill),
    else 16 (decode: fewer padding rows, and each routed expert's weights still read once)."""
    return 64 if tokens * top_k >= 32 * experts else 16


def _check_top_k(top_k, experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int in [1, {experts}] (the experts), got {top_k!r}")


def _check_scoring(scoring: str) -> None:
    if scoring not in MOE_SCORINGS:
        raise ValueError(f"scoring must be one of {MOE_SCORINGS}, got {scoring!r}")


def moe_route(router_logits, top_k: int, *, renormalize: bool = True, scoring="softmax",
              stream=None):  # fmt: skip
    """(weights [T, k] float32, ids [T, k] int32) for router_logits [T, E] (any float dtype):
    each token's k experts with the largest logits (ties to the lower id), descending, weighted
    by softmax over E (or sigmoid; softmax_topk: softmax over the k selected logits), divided
    by their sum if `renormalize`
    (reference.moe_route: the ids agree exactly)."""
    rv = view(router_logits, "router_logits")
    check_dtype(rv, FLOAT_DTYPES)
    check_ndim(rv, 2)
    tokens, experts = rv.shape
    if experts == 0:
        raise ValueError(f"{rv.describe()} must have at least one expert")
    _check_top_k(top_k, experts)
    _check_scoring(scoring)
    if not kernel_or_reference("moe_route", [rv], support.moe_route(experts)):
        reference_on_torch("moe_route", [rv])  # (torch tensors only)
        from ..reference.moe import moe_route as route

        weights, ids = route(router_logits, top_k, renormalize, scoring)
        return weights, ids.int()
    module, device, handle = launch_context([rv], stream)
    with on_launch_stream([rv], device, handle):
        ids = empty_like(rv, (tokens, top_k), "int32")
        weights = empty_like(rv, (tokens, top_k), "float32")
    _launch_route(module, rv, view(ids, "ids"), view(weights, "weights"), top_k, renormalize,
                  scoring, device, handle)  # fmt: skip
    return weights, ids


def _launch_route(module, rv, iv, wv, top_k, renormalize, scoring, device, handle) -> None:
    module.moe_route(
        ids=iv.ptr,
        weights=wv.ptr,
        logits=rv.ptr,
        tokens=rv.shape[0],
        logits_stride=rows_of(rv)[1],
        experts=rv.shape[1],
        top_k=top_k,
        renormalize=bool(renormalize),
        scoring=MOE_SCORINGS.index(scoring),
        dtype=DTYPE_CODES[rv.dtype],
        device=device,
        stream=handle,
    )


def moe_align(ids, num_experts: int, tile_m: int, *, stream=None):
    """(sorted_pairs int32, tile_expert int32) for expert ids [T, k] int32 in [0, E): the
    (token, slot) pairs grouped by expert and padded to tile_m (16 or 64), the layout of
    reference.moe.align_by_expert (equal to it element for element). Ids outside [0, E) are
    not checked on the GPU (moe_route never writes one)."""
    iv = view(ids, "ids")
    check_dtype(iv, ("int32",))
    check_ndim(iv, 2)
    check_contiguous(iv)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if tile_m not in MOE_TILES:
        raise ValueError(f"tile_m must be one of {MOE_TILES}, got {tile_m!r}")
    if not kernel_or_reference("moe_align", [iv], support.moe_route(num_experts)):
        reference_on_torch("moe_align", [iv])  # (torch tensors only)
        from ..reference.moe import align_by_expert

        return align_by_expert(ids, num_experts, tile_m)
    module, device, handle = launch_context([iv], stream)
    with on_launch_stream([iv], device, handle):
        sorted_pairs, tile_expert = _align_outputs(iv, iv.numel, num_experts, tile_m)
    _launch_align(module, iv, sorted_pairs, tile_expert, num_experts, tile_m, device, handle)
    return sorted_pairs, tile_expert


def _align_outputs(like, pairs: int, experts: int, tile_m: int):
    from ..reference.moe import padded_rows

    rows = padded_rows(pairs, experts, tile_m)
    return empty_like(like, (rows,), "int32"), empty_like(like, (rows // tile_m,), "int32")


def _launch_align(module, iv, sorted_pairs, tile_expert, experts, tile_m, device, handle):
    module.moe_align(
        sorted_pairs=view(sorted_pairs, "sorted_pairs").ptr,
        tile_expert=view(tile_expert, "tile_expert").ptr,
        ids=iv.ptr,
        pairs=iv.numel,
        experts=experts,
        tile_m=tile_m,
        device=device,
        stream=handle,
    )


def _quantized(weight) -> bool:
    """Whether `weight` is a QuantizedWeight (whose module, and torch, are then imported)."""
    module = sys.modules.get("pagedkern.reference.quantized_weight")
    return module is not None and isinstance(weight, module.QuantizedWeight)


def fused_moe(
    hidden,
    router_logits,
    w_gate_up,
    w_down,
    top_k: int,
    *,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
    w_gate_up_bias=None,
    w_down_bias=None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    tile_m: int | None = None,
    split_k: int | tuple[int, int] | None = None,
    stream=None,
):
    """[T, H] out for hidden [T, H], router_logits [T, E] (any float dtype; routing in fp32),
    w_gate_up [E, 2I, H] (gate rows then up rows) and w_down [E, H, I], both in hidden's dtype:
    each token through its top_k experts (renormalize: their weights divided by their sum),
    summed by weight. w_gate_up_bias [E, 2I] / w_down_bias [E, H] (hidden's dtype, optional):
    each expert's biases (gpt-oss), added before each GEMM's rounding; activation
    "clamped_swiglu": gpt-oss's, with swiglu_alpha and swiglu_limit. See reference/moe.py for
    the exact semantics. tile_m: the grouped GEMM's row tile (16 or 64; None: moe_tile_m's;
    the moe_gemm:sm90_wgmma variant's kernels take 64, see ops/moe_sm90.py).
    split_k: K splits of the (gate_up, down) grouped GEMMs, or one for both (None: moe_splits's
    choice; split-K is not yet verified on GPU, moe_gemm:no_split_k keeps 1)."""
    if _quantized(w_gate_up) or _quantized(w_down):  # stacked QuantizedWeights: ops/moe_quant.py
        from .moe_quant import fused_moe_quantized

        return fused_moe_quantized(
            hidden, router_logits, w_gate_up, w_down, top_k, renormalize=renormalize,
            activation=activation, scoring=scoring, w_gate_up_bias=w_gate_up_bias,
            w_down_bias=w_down_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
            tile_m=tile_m, split_k=split_k, stream=stream, routing=sys.modules[__name__],
        )  # fmt: skip
    hv, rv = view(hidden, "hidden"), view(router_logits, "router_logits")
    gv, dv = view(w_gate_up, "w_gate_up"), view(w_down, "w_down")
    for v in (hv, rv, gv, dv):
        check_dtype(v, FLOAT_DTYPES)
    check_ndim(hv, 2)
    check_ndim(gv, 3)
    tokens, h = hv.shape
    experts = gv.shape[0]
    if gv.shape[1] % 2 or gv.shape[1] == 0 or experts == 0:
        raise ValueError(f"{gv.describe()} must be [E > 0, 2I > 0, H]: gate rows then up rows")
    inter = gv.shape[1] // 2
    check_shape(gv, (experts, 2 * inter, h))
    check_shape(dv, (experts, h, inter))
    check_shape(rv, (tokens, experts))
    check_same_dtype(hv, gv)
    check_same_dtype(hv, dv)
    _check_top_k(top_k, experts)
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    biases = []
    for name, b, rows in (("w_gate_up_bias", w_gate_up_bias, 2 * inter), ("w_down_bias",
                          w_down_bias, h)):  # fmt: skip
        if b is not None:
            bv = view(b, name)
            check_shape(bv, (experts, rows))
            check_same_dtype(hv, bv)
            check_contiguous(bv)
            biases.append(bv)
        else:
            biases.append(None)
    _check_scoring(scoring)
    if tile_m is not None and tile_m not in MOE_TILES:
        raise ValueError(f"tile_m must be one of {MOE_TILES} or None, got {tile_m!r}")
    forced_splits = check_split_k(split_k)
    if len({str(v.device) for v in (hv, rv, gv, dv)}) > 1:
        raise ValueError(
            f"{hv.describe()}, {rv.describe()}, {gv.describe()} and {dv.describe()} must be on "
            "the same device"
        )
    views = (hv, rv, gv, dv, *(b for b in biases if b is not None))
    if len({str(v.device) for v in views}) > 1:
        raise ValueError("the expert biases must be on hidden's device")
    if not kernel_or_reference("fused_moe", views, support.fused_moe(hv.dtype, experts)):
        reference = reference_on_torch("fused_moe", views)
        return reference.fused_moe(
            hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation, scoring,
            w_gate_up_bias, w_down_bias, swiglu_alpha, swiglu_limit,
        )  # fmt: skip
    check_contiguous(gv)
    check_contiguous(dv)
    _, hidden_stride = rows_of(hv)
    wgmma = moe_sm90.takes(hv, gv, dv, hidden_stride)  # variant moe_gemm:sm90_wgmma
    tile = moe_sm90.TILE_M if wgmma else tile_m or moe_tile_m(tokens, top_k, experts)
    module, device, handle = launch_context(views, stream)
    wv, sorted_pairs, tile_expert, h_buf, y_buf, out = routed_buffers(
        module, device, handle, views, hv, rv, top_k, experts, inter, tile, renormalize, scoring
    )
    h_rows = sorted_pairs.shape[0]
    splits = (1, 1) if wgmma else forced_splits or moe_splits(
        tokens, top_k, experts, h, inter, tile, sm_count(module, device))  # fmt: skip
    workspace = split_workspace(views, device, handle, hv, splits, h_rows, top_k, inter)
    (module.moe_experts_sm90 if wgmma else module.moe_experts)(
        out=view(out, "out").ptr,
        h=view(h_buf, "h").ptr,
        y=view(y_buf, "y").ptr,
        hidden=hv.ptr,
        w_gate_up=gv.ptr,
        w_down=dv.ptr,
        gate_up_bias=0 if biases[0] is None else biases[0].ptr,
        down_bias=0 if biases[1] is None else biases[1].ptr,
        weights=wv.ptr,
        sorted_pairs=view(sorted_pairs, "sorted_pairs").ptr,
        tile_expert=view(tile_expert, "tile_expert").ptr,
        tokens=tokens,
        hidden_size=h,
        inter_size=inter,
        hidden_stride=hidden_stride,
        out_stride=h,
        padded_rows=h_rows,
        experts=experts,
        top_k=top_k,
        tile_m=tile,
        activation=MOE_ACTIVATIONS.index(activation),
        swiglu_alpha=float(swiglu_alpha),
        swiglu_limit=float(swiglu_limit),
        dtype=DTYPE_CODES[hv.dtype],
        device=device,
        stream=handle,
        workspace=0 if workspace is None else view(workspace, "workspace").ptr,
        gate_up_splits=splits[0],
        down_splits=splits[1],
    )
    return out


def routed_buffers(module, device, handle, views, hv, rv, top_k: int, experts: int, inter: int,
                   tile: int, renormalize: bool, scoring: str) -> tuple:  # fmt: skip
    """Route and group the tokens on the launch stream (the router and grouping kernels), and
    make the buffers both grouped GEMMs use: (the routing weights' view, sorted pairs, each
    tile's expert, h [padded rows, inter], y [pairs, H], out [T, H])."""
    tokens, h = hv.shape
    pairs = tokens * top_k
    with on_launch_stream(views, device, handle):
        ids = empty_like(hv, (tokens, top_k), "int32")
        weights = empty_like(hv, (tokens, top_k), "float32")
        sorted_pairs, tile_expert = _align_outputs(hv, pairs, experts, tile)
        h_buf = empty_like(hv, (sorted_pairs.shape[0], inter))  # activation rows, sorted order
        y_buf = empty_like(hv, (pairs, h))  # each pair's down projection, by pair
        out = empty_like(hv, (tokens, h))
    iv, wv = view(ids, "ids"), view(weights, "weights")
    _launch_route(module, rv, iv, wv, top_k, renormalize, scoring, device, handle)
    _launch_align(module, iv, sorted_pairs, tile_expert, experts, tile, device, handle)
    return wv, sorted_pairs, tile_expert, h_buf, y_buf, out


def split_workspace(views, device, handle, hv, splits: tuple[int, int], padded: int,
                    top_k: int, inter: int):  # fmt: skip
    """The grouped GEMMs' split-K fp32 partial sums (csrc/moe.h: gate_up's [splits, padded
    rows, 2I], then down's [splits, T*k, H] in the same buffer), sized from the shapes; None
    without a split."""
    if splits == (1, 1):
        return None
    tokens, h = hv.shape
    floats = max(splits[0] * padded * 2 * inter, splits[1] * tokens * top_k * h)
    with on_launch_stream(views, device, handle):
        return empty_like(hv, (floats,), "float32")
