"""The CPU backend's layer tail: a Llama-family layer after attention in one C++ call
(csrc/cpu/layer_tail.h): O GEMV, residual add + RMSNorm, gate/up GEMV, SiLU (or GELU-tanh) x
mul, down GEMV, residual add + the next norm (with sandwich norms, Gemma's, each GEMV's output
normed before its add), with the quantized GEMV of quant_gemv.py for the products.

At batch 1 those ~15 torch ops and three GEMV wrappers cost more in dispatch than in math
(~70 µs a layer of SmolLM2-135M on an idle Xeon core). A layer runs here when the C++ module is
built, the `cpu_layer_tail` variant is `fused` (the default), its GEMMs run csrc/cpu/'s GEMV
(`cpu_quant_linear` not `int_pack`), and its shape is the plain one: int4/int8 O, gate/up and
down weights, a SiLU or GeGLU MLP, fp32 activations, one rank. A mixture-of-experts layer
runs here too where ops/cpu/moe_quant.layer_mlp takes its MLP (fp32 router, int4/int8
experts, `cpu_moe` fused): router, top-k, experts and shared expert in the same call. Every
other layer, and every other backend, runs the ops one by one. Whether a layer runs here is
fixed per model and variant, never per batch: a row's result depends on its own inputs only
(the GEMV's rows and the elementwise passes are row by row), so the engine's greedy outputs
stay independent of batch make-up. Not the ops' function bit for bit (its sums and e^x round
differently, ~1e-6 relative): tested against the reference with a tolerance
(tests/test_cpu_backend_layer_tail.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import variants
from . import quant_gemv
from .module_args import (
    ACTIVATIONS,
    NO_LINEAR,
    LinearTuple,
    address,
    fp32_vector,
    linear_tuple,
    quantized_fits,
)
from .moe_quant import layer_mlp


def runs(layer, hidden: int, intermediate: int, q_size: int, hidden_act: str) -> bool:
    """Whether `layer` (model/weights.py LayerWeights) has the dense shape this call computes
    (a MoE layer's MLP: moe_quant.layer_mlp)."""
    return (
        hidden_act in ACTIVATIONS
        and layer.router is None
        and attention_fits(layer, hidden, q_size)
        and quantized_fits(layer.gate_up, layer.gate_up_bias, 2 * intermediate, hidden)
        and quantized_fits(layer.down, layer.down_bias, hidden, intermediate)
    )


def attention_fits(layer, hidden: int, q_size: int) -> bool:
    """Whether the layer's O weight and norms are ones this call takes."""
    return (
        fp32_vector(layer.attn_out_norm, hidden)
        and fp32_vector(layer.mlp_out_norm, hidden)
        and quantized_fits(layer.o, layer.o_bias, hidden, q_size)
        and fp32_vector(layer.post_norm, hidden)
    )


class TailWeights(NamedTuple):
    """A layer's weights as the C++ call takes them."""

    o: LinearTuple
    gate_up: LinearTuple  # (a MoE layer: moe_quant.NO_LINEAR, as down)
    down: LinearTuple
    moe: object | None  # the module's MoeMlp of a MoE layer


class LayerTail:
    """The fused tail for one model's layers, for the calls of one step: `for_step()` is None
    where the variant or the module rules it out; then `__call__(attn, residual, layer,
    next_norm)` -> (h, residual), or None for a layer it refuses (the caller runs the ops).
    routing: a MoE model's (top_k, renormalize, scoring), as model/moe.py routes."""

    def __init__(
        self, hidden: int, intermediate: int, q_size: int, hidden_act: str, eps: float,
        routing: tuple[int, bool, str] | None = None,
    ):  # fmt: skip
        self.hidden, self.intermediate, self.q_size = hidden, intermediate, q_size
        self.hidden_act, self.eps, self.routing = hidden_act, eps, routing
        self._layers: dict[int, tuple] = {}  # id(layer) -> (layer, its weights' tuples or None)
        self._step: dict | None = None  # the step's threads, path and width (for_step)
        self._call = None  # pagedkern._cpu.layer_tail (for_step)

    def for_step(self) -> LayerTail | None:
        """Self, with the step's threads, GEMV path and activation width read once; None when
        this step runs the ops (variant `ops`, `cpu_quant_linear:int_pack`, no module)."""
        if variants.selected("cpu_layer_tail") != "fused" or not quant_gemv.available():
            return None
        linear = variants.selected("cpu_quant_linear")
        if linear == "int_pack":
            return None
        module = quant_gemv.cpu_module()
        self._step = dict(
            threads=torch.get_num_threads(),
            parallel_min_macs=quant_gemv.PARALLEL_MIN_MACS,
            path=module.PATHS[quant_gemv.best_path()],
            activation_bits=8 if linear == "int8_activations" else 16,
        )
        self._call = module.layer_tail
        return self

    @property
    def settings(self) -> dict:
        """The step's threads, GEMV path and activation width (for_step)."""
        return self._step

    def weights_of(self, layer) -> TailWeights | None:
        """The layer's weights for the call, or None where it refuses the layer. Built once a
        layer, except a MoE layer's under a changed `cpu_moe` variant (tests switch it)."""
        moe_variant = variants.selected("cpu_moe") if layer.router is not None else None
        found = self._layers.get(id(layer))
        if found is None or found[0] is not layer or found[1] != moe_variant:
            found = self._layers[id(layer)] = (layer, moe_variant, self._weights(layer))
        return found[2]

    def _weights(self, layer) -> TailWeights | None:
        if layer.router is None:
            if not runs(layer, self.hidden, self.intermediate, self.q_size, self.hidden_act):
                return None
            return TailWeights(
                linear_tuple(layer.o, layer.o_bias),
                linear_tuple(layer.gate_up, layer.gate_up_bias),
                linear_tuple(layer.down, layer.down_bias),
                None,
            )
        if self.routing is None or not attention_fits(layer, self.hidden, self.q_size):
            return None
        moe = layer_mlp(layer, *self.routing, self.hidden_act)
        if moe is None:
            return None
        return TailWeights(linear_tuple(layer.o, layer.o_bias), NO_LINEAR, NO_LINEAR, moe)

    def __call__(
        self,
        attn: torch.Tensor,
        residual: torch.Tensor,
        layer,
        next_norm: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """attn [T, Hq, D] fp32 (contiguous), residual [T, H] fp32 updated in place ->
        (h [T, H] normed by next_norm: `out` if given, residual); None: run the ops instead."""
        weights = self.weights_of(layer)
        if (
            weights is None
            or attn.dtype != torch.float32
            or residual.dtype != torch.float32
            or not attn.is_contiguous()
            or not residual.is_contiguous()
            or not fp32_vector(next_norm, self.hidden)
        ):
            return None
        m = residual.shape[0]
        if attn.shape[0] != m:
            raise ValueError(f"attn {tuple(attn.shape)} and residual {tuple(residual.shape)} rows")
        h = torch.empty(m, self.hidden) if out is None else out
        if h.shape != residual.shape or h.dtype != torch.float32 or not h.is_contiguous():
            raise ValueError(f"out {tuple(h.shape)} {h.dtype}: contiguous like the residual")
        o, gate_up, down, moe = weights
        self._call(
            o=o, gate_up=gate_up, down=down, moe=moe, post_norm=layer.post_norm.data_ptr(),
            next_norm=next_norm.data_ptr(), eps=self.eps, m=m, hidden=self.hidden,
            intermediate=self.intermediate, attn=attn.data_ptr(), attn_stride=self.q_size,
            residual=residual.data_ptr(), h_out=h.data_ptr(),
            activation=ACTIVATIONS[self.hidden_act], attn_out_norm=address(layer.attn_out_norm),
            mlp_out_norm=address(layer.mlp_out_norm), **self._step,
        )  # fmt: skip
        return h, residual
