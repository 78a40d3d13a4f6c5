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
"""

from __future__ import annotations

import torch

from ...reference.moe import moe_route
from ...reference.quantized_weight import QuantizedWeight
from .. import variants
from . import layer_tail, quant_gemv

_KEY = "cpu_moe_experts"  # where a stacked weight keeps the module's MoeExperts


def _experts(w_gate_up: QuantizedWeight, w_down: QuantizedWeight, biases, activation: str):
    """The module's MoeExperts for these stacked weights, built once (its tiles per expert)."""
    key = (id(w_down), *(id(b) for b in biases), activation)
    found = w_gate_up.packed.get(_KEY)
    if found is None or found[0] != key:
        experts, hidden, inter = w_down.shape  # [E, H, I]

        def tuples(w: QuantizedWeight, bias) -> list:
            return [
                layer_tail.linear_tuple(w.expert(e), None if bias is None else bias[e])
                for e in range(experts)
            ]

        made = quant_gemv.cpu_module().MoeExperts(
            gate_up=tuples(w_gate_up, biases[0]), down=tuples(w_down, biases[1]),
            hidden_size=hidden, intermediate=inter,
            activation=layer_tail.ACTIVATIONS[activation],
        )  # fmt: skip
        found = w_gate_up.packed[_KEY] = (key, made, w_down, biases)  # (kept alive with it)
    return found[1]


def applies(hidden, w_gate_up, w_down, activation: str, biases) -> bool:
    """Whether the C++ call computes this one (the variant, the module, the shapes)."""
    experts, two_inter, h = w_gate_up.shape
    inter = w_down.shape[2]
    return (
        variants.selected("cpu_moe") == "fused"
        and quant_gemv.available()
        and hidden.dtype == torch.float32
        and activation in layer_tail.ACTIVATIONS
        and variants.selected("cpu_quant_linear") != "int_pack"
        and all(
            layer_tail.quantized_fits(w.expert(0), None, n, k)
            for w, n, k in ((w_gate_up, two_inter, h), (w_down, h, inter))
        )
        and all(
            b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape[0] == experts)
            for b in biases
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
    _experts(w_gate_up, w_down, biases, activation).run(
        x.data_ptr(), tokens, top_k, ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
        torch.get_num_threads(), quant_gemv.PARALLEL_MIN_MACS,
        quant_gemv.cpu_module().PATHS[quant_gemv.best_path()],
        8 if linear == "int8_activations" else 16,
    )  # fmt: skip
    return out
