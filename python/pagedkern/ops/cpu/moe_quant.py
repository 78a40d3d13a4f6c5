"""The CPU backend's fused_moe over int4 / int8 experts: the reference's routing, then every
routed expert's two GEMVs, the activation and the weighted sum in one C++ call a layer
(csrc/cpu/moe_experts.h), over the experts' 16-row tiles (quant_gemv.packed, made once per
expert) and the dense layers' GEMV.

Why. The host loop it replaces (ops/moe_quant.experts_on_host, still the reference backend's
and the fallback) makes ~10 torch calls and two quant_linear calls per expert that received
tokens: a Qwen3-MoE decode token routes to 8 experts a layer, ~100 calls, far more dispatch
than the GEMVs' arithmetic. It runs where the C++ module is built and the call fits: fp32
hidden, SiLU or GELU-tanh gates (gpt-oss's clamped SwiGLU runs the loop), int4 / int8 experts
the GEMV takes, biases fp32 if any. Its activation's e^x is a polynomial (~3e-7 relative), so
it is the host loop's function within fp32 rounding, not bit for bit; a token's result depends
on its own routing only (its pairs summed in expert order), never on the batch.
`PAGEDKERN_KERNELS=cpu_moe:loop` runs the host loop instead.

layer_mlp builds the same call with the layer's router and shared expert for the layer tail
(csrc/cpu/moe_mlp.h), which then runs the whole MoE MLP, routing included, in C++.
"""

from __future__ import annotations

import torch

from ...reference.moe import moe_route
from ...reference.quantized_weight import QuantizedWeight
from .. import variants
from . import module_args, quant_gemv

_KEY = "cpu_moe_experts"  # where a stacked weight keeps the module's MoeMlp of its experts
SCORINGS = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}  # csrc/cpu/moe_mlp.h's MoeScoring


def _expert_tuples(w: QuantizedWeight, bias) -> list:
    """Each expert of a stacked [E, N, K] weight as csrc/cpu/module.h takes a weight (its
    tiles packed once, kept on w.expert(e))."""
    return [
        module_args.linear_tuple(w.expert(e), None if bias is None else bias[e])
        for e in range(w.shape[0])
    ]


def _mlp(w_gate_up: QuantizedWeight, w_down: QuantizedWeight, biases, activation: str, **more):
    """The module's MoeMlp over these stacked experts (more: its router and shared expert)."""
    _, hidden, inter = w_down.shape  # [E, H, I]
    return quant_gemv.cpu_module().MoeMlp(
        gate_up=_expert_tuples(w_gate_up, biases[0]), down=_expert_tuples(w_down, biases[1]),
        hidden_size=hidden, intermediate=inter, activation=module_args.ACTIVATIONS[activation],
        **more,
    )  # fmt: skip


def _experts(w_gate_up: QuantizedWeight, w_down: QuantizedWeight, biases, activation: str):
    """The module's MoeMlp for these stacked weights without a router (ops.fused_moe's call,
    routed by the caller), built once."""
    key = (id(w_down), *(id(b) for b in biases), activation)
    found = w_gate_up.packed.get(_KEY)
    if found is None or found[0] != key:
        made = _mlp(w_gate_up, w_down, biases, activation)
        found = w_gate_up.packed[_KEY] = (key, made, w_down, biases)  # (kept alive with it)
    return found[1]


def layer_mlp(layer, top_k: int, renormalize: bool, scoring: str, activation: str):
    """A mixture-of-experts layer's whole MLP as the module's MoeMlp (csrc/cpu/moe_mlp.h: its
    fp32 router, top-k, int4 / int8 experts and Qwen2-MoE's shared expert), for the layer tail
    to run in place of a dense MLP; None where the call does not compute it (the variant, the
    shapes, gpt-oss's clamped SwiGLU): the layer then runs model/moe.py's ops."""
    w_gate_up, w_down, router = layer.experts_gate_up, layer.experts_down, layer.router
    biases = (layer.experts_gate_up_bias, layer.experts_down_bias)
    if not isinstance(w_gate_up, QuantizedWeight) or not isinstance(w_down, QuantizedWeight):
        return None
    experts, hidden = router.shape
    shared = layer.gate_up is not None
    fits = (
        scoring in SCORINGS
        and 0 < top_k <= experts
        and w_gate_up.shape[0] == experts
        and module_args.fp32_tensor(router, (experts, hidden))
        and module_args.fp32_tensor(layer.router_bias, (experts,))
        and experts_fit(w_gate_up, w_down, activation, biases)
    )
    if shared:
        size = layer.down.shape[1]
        fits = (
            fits
            and layer.gate_up_bias is None
            and layer.down_bias is None
            and module_args.quantized_fits(layer.gate_up, None, 2 * size, hidden)
            and module_args.quantized_fits(layer.down, None, hidden, size)
            and module_args.fp32_tensor(layer.shared_gate, (1, hidden))
        )
    if not fits or (not shared and layer.shared_gate is not None):
        return None
    more = dict(
        router=router.data_ptr(), router_bias=module_args.address(layer.router_bias),
        top_k=top_k, scoring=SCORINGS[scoring], renormalize=renormalize,
    )  # fmt: skip
    if shared:
        more |= dict(
            shared_gate_up=module_args.linear_tuple(layer.gate_up, None),
            shared_down=module_args.linear_tuple(layer.down, None),
            shared_gate=layer.shared_gate.data_ptr(),
        )
    return _mlp(w_gate_up, w_down, biases, activation, **more)


def applies(hidden, w_gate_up, w_down, activation: str, biases) -> bool:
    """Whether the C++ call computes this one (the variant, the module, the shapes)."""
    return hidden.dtype == torch.float32 and experts_fit(w_gate_up, w_down, activation, biases)


def experts_fit(w_gate_up, w_down, activation: str, biases) -> bool:
    """Whether the module's MoeMlp takes these stacked experts (and the variants select it)."""
    experts, two_inter, h = w_gate_up.shape
    inter = w_down.shape[2]
    return (
        variants.selected("cpu_moe") == "fused"
        and quant_gemv.available()
        and activation in module_args.ACTIVATIONS
        and variants.selected("cpu_quant_linear") != "int_pack"
        and all(
            module_args.quantized_fits(w.expert(0), None, n, k)
            for w, n, k in ((w_gate_up, two_inter, h), (w_down, h, inter))
        )
        and all(
            module_args.fp32_tensor(b, (experts, n))
            for b, n in zip(biases, (two_inter, h), strict=True)
        )
    )


def fused_moe_quantized(
    hidden, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool, activation: str,
    scoring: str, biases=(None, None),
) -> torch.Tensor:  # fmt: skip
    """[T, H] fp32: ops.fused_moe's function for a call applies() accepts (arguments validated
    by ops.fused_moe)."""
    tokens = hidden.shape[0]
    out = torch.empty(tokens, hidden.shape[1])
    if tokens == 0:
        return out
    weights, ids = moe_route(router_logits, top_k, renormalize, scoring)
    ids = ids.to(torch.int32).contiguous()
    weights = weights.float().contiguous()
    x = hidden.contiguous()
    linear = variants.selected("cpu_quant_linear")
    _experts(w_gate_up, w_down, biases, activation).run_routed(
        x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
        torch.get_num_threads(), quant_gemv.PARALLEL_MIN_MACS,
        quant_gemv.cpu_module().PATHS[quant_gemv.best_path()],
        8 if linear == "int8_activations" else 16,
    )  # fmt: skip
    return out
