"""fused_moe: the mixture-of-experts MLP (router top-k, tokens grouped by expert, each expert's
gated MLP, the weighted combine). Validation here; no kernel yet, so every call runs the
PyTorch reference, on the tensors' own device (CUDA tensors stay on the GPU)."""

from __future__ import annotations

from . import support
from .arrays import FLOAT_DTYPES, check_dtype, check_ndim, check_same_dtype, check_shape, view
from .launch import kernel_or_reference, reference_on_torch

MOE_ACTIVATIONS = ("silu", "gelu_tanh")


def fused_moe(
    hidden,
    router_logits,
    w_gate_up,
    w_down,
    top_k: int,
    *,
    renormalize: bool = True,
    activation: str = "silu",
):
    """[T, H] out for hidden [T, H], router_logits [T, E] (any float dtype; softmax in fp32),
    w_gate_up [E, 2I, H] (gate rows then up rows) and w_down [E, H, I], both in hidden's dtype:
    each token through its top_k experts (renormalize: their weights divided by their sum),
    summed by weight. See reference/moe.py for the exact semantics."""
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
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int in [1, {experts}] (the experts), got {top_k!r}")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    if len({str(v.device) for v in (hv, rv, gv, dv)}) > 1:
        raise ValueError(
            f"{hv.describe()}, {rv.describe()}, {gv.describe()} and {dv.describe()} must be on "
            "the same device"
        )
    views = (hv, rv, gv, dv)
    # no kernel: the reference, which the strict "cuda" backend refuses on CUDA arrays too
    kernel_or_reference("fused_moe", views, support.fused_moe())
    reference = reference_on_torch("fused_moe", views)
    return reference.fused_moe(
        hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation
    )
