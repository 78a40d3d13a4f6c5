"""The CPU backend's layer tail: a Llama-family layer after attention in one C++ call
(csrc/cpu/layer_tail.h): O GEMV, residual add + RMSNorm, gate/up GEMV, SiLU (or GELU-tanh) x
mul, down GEMV, residual add + the next norm (with sandwich norms, Gemma's, each GEMV's output
normed before its add), with the quantized GEMV of quant_gemv.py for the products.

At batch 1 those ~15 torch ops and three GEMV wrappers cost more in dispatch than in math
(~70 µs a layer of SmolLM2-135M on an idle Xeon core). A layer runs here when the C++ module is
built, the `cpu_layer_tail` variant is `fused` (the default), its GEMMs run csrc/cpu/'s GEMV
(`cpu_quant_linear` not `int_pack`), and its shape is the plain one: int4/int8 O, gate/up and
down weights, a SiLU or GeGLU MLP, no experts, fp32 activations, one rank. Every
other layer, and every other backend, runs the ops one by one. Whether a layer runs here is
fixed per model and variant, never per batch: a row's result depends on its own inputs only
(the GEMV's rows and the elementwise passes are row by row), so the engine's greedy outputs
stay independent of batch make-up. Not the ops' function bit for bit (its sums and e^x round
differently, ~1e-6 relative): tested against the reference with a tolerance
(tests/test_cpu_backend_layer_tail.py)."""

from __future__ import annotations

import torch

from ...reference.quantized_weight import QuantizedWeight
from .. import variants
from . import quant_gemv

# (tile format code, tiles, scales, bias, n, k): as csrc/cpu/module.cpp takes a weight
_LinearTuple = tuple[int, int, int, int, int, int]


def fp32_vector(t: torch.Tensor | None, size: int) -> bool:
    return t is None or (
        t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == (size,)
    )


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


def runs(layer, hidden: int, intermediate: int, q_size: int, hidden_act: str) -> bool:
    """Whether `layer` (model/weights.py LayerWeights) has the shape this call computes."""
    return (
        hidden_act in ACTIVATIONS
        and layer.router is None
        and fp32_vector(layer.attn_out_norm, hidden)
        and fp32_vector(layer.mlp_out_norm, hidden)
        and quantized_fits(layer.o, layer.o_bias, hidden, q_size)
        and quantized_fits(layer.gate_up, layer.gate_up_bias, 2 * intermediate, hidden)
        and quantized_fits(layer.down, layer.down_bias, hidden, intermediate)
        and fp32_vector(layer.post_norm, hidden)
    )


def linear_tuple(w: QuantizedWeight, bias: torch.Tensor | None) -> _LinearTuple:
    """A quantized weight (and bias) as csrc/cpu/module.cpp takes it (tiles packed once)."""
    n, k = w.shape
    address = 0 if bias is None else bias.data_ptr()
    tiles = quant_gemv.packed(w)
    code = quant_gemv.tile_format_code(w)
    return (code, tiles.data_ptr(), quant_gemv.scales_address(w), address, n, k)


class LayerTail:
    """The fused tail for one model's layers, for the calls of one step: `for_step()` is None
    where the variant or the module rules it out; then `__call__(attn, residual, layer,
    next_norm)` -> (h, residual), or None for a layer `runs` refuses (the caller runs the ops)."""

    def __init__(self, hidden: int, intermediate: int, q_size: int, hidden_act: str, eps: float):
        self.hidden, self.intermediate, self.q_size = hidden, intermediate, q_size
        self.hidden_act, self.eps = hidden_act, eps
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

    def weights_of(self, layer) -> tuple | None:
        """The layer's (o, gate_up, down) tuples, or None where `runs` refuses it."""
        found = self._layers.get(id(layer))
        if found is None or found[0] is not layer:
            fused = None
            if runs(layer, self.hidden, self.intermediate, self.q_size, self.hidden_act):
                fused = (
                    linear_tuple(layer.o, layer.o_bias),
                    linear_tuple(layer.gate_up, layer.gate_up_bias),
                    linear_tuple(layer.down, layer.down_bias),
                )
            found = self._layers[id(layer)] = (layer, fused)
        return found[1]

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
        o, gate_up, down = weights
        self._call(
            o=o, gate_up=gate_up, down=down, post_norm=layer.post_norm.data_ptr(),
            next_norm=next_norm.data_ptr(), eps=self.eps, m=m, hidden=self.hidden,
            intermediate=self.intermediate, attn=attn.data_ptr(), attn_stride=self.q_size,
            residual=residual.data_ptr(), h_out=h.data_ptr(),
            activation=ACTIVATIONS[self.hidden_act], attn_out_norm=address(layer.attn_out_norm),
            mlp_out_norm=address(layer.mlp_out_norm), **self._step,
        )  # fmt: skip
        return h, residual
