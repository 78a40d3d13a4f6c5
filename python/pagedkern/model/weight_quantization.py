"""Weight-only quantization of a model's runtime weights: every layer's linear weights, the
stacked experts of MoE layers and the LM head, each put in its mode."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from .quantized_linear import QuantizedWeight, quantizable, quantize, quantize_experts
from .weights import LINEAR_FIELDS, LayerWeights, Linear, LlamaWeights

# The LM head's format per mode (measured in bench/test_bench_quant.py; see README).
LM_HEAD_MODE = {"none": "none", "int8": "int8", "int4": "int8"}


def quantize_weights(
    weights: LlamaWeights, mode: str, group_size: int, head_mode: str | None = None
) -> LlamaWeights:
    """Every layer's linear weights in `mode` ('none' / 'int8' / 'int4') and the LM head in
    head_mode (default: LM_HEAD_MODE[mode]); weights already in the target format are kept as
    they are (and int8 with a scale per group, a GGUF's exact Q8_0 / Q6_K, in any quantized
    mode), others are requantized from their floats ('none': dequantized to fp32, float
    weights kept in their dtype). A tied embedding follows the head (its rows are dequantized
    at lookup). A MoE layer's stacked experts follow the layers' mode (convert_experts)."""

    def kept(w: Linear, mode: str) -> bool:
        """Whether a quantized w stays as it is in `mode`: its format, or int8 with a scale per
        group (a GGUF's Q8_0 / Q6_K, exact) in any quantized mode."""
        if not isinstance(w, QuantizedWeight) or mode == "none":
            return False
        same = w.format == mode and (mode == "int8" or w.group_size == group_size)
        return w.int8_per_group or same

    def convert(w: Linear | None, mode: str = mode) -> Linear | None:
        if w is None:  # (a MoE layer's absent dense MLP)
            return None
        if kept(w, mode):
            return w
        if isinstance(w, QuantizedWeight):
            w = w.dequantize_rows()
        if mode == "none" or not quantizable(w.shape[-1], mode, group_size):
            return w  # (in-features no quantized form divides: float, as experts stay)
        return quantize(w, mode, group_size)

    def plain(w: Linear) -> torch.Tensor:
        return w.dequantize_rows() if isinstance(w, QuantizedWeight) else w

    def convert_experts(layer: LayerWeights) -> dict[str, Linear | None]:
        """The stacked experts in `mode`: both GEMMs or neither (they stay float where an
        in-features count does not divide into the mode's blocks). Each keeps its own form
        where `kept` (a Q4_K_M file's Q4_K gate/up beside its Q6_K down, both exact: the CPU
        kernel takes each projection's form; gemm_weights gives CUDA's kernel one)."""
        pair = {"experts_gate_up": layer.experts_gate_up, "experts_down": layer.experts_down}
        if layer.experts_gate_up is None:
            return pair
        if mode == "none" or not all(
            quantizable(w.shape[-1], mode, group_size) for w in pair.values()
        ):
            return {name: plain(w).float() for name, w in pair.items()}
        return {
            name: w if kept(w, mode) else quantize_experts(plain(w), mode, group_size)
            for name, w in pair.items()
        }

    layers = [
        LayerWeights(
            **{
                f.name: convert(v) if f.name in LINEAR_FIELDS else v
                for f in fields(LayerWeights)
                for v in [getattr(layer, f.name)]
            }
            | convert_experts(layer)
        )
        for layer in weights.layers
    ]
    head = convert(weights.lm_head, LM_HEAD_MODE[mode] if head_mode is None else head_mode)
    embed = head if weights.tied else plain(weights.embed)
    return LlamaWeights(embed, layers, weights.norm, head, weights.rope_freq_factors)


def experts_in_one_form(layer: LayerWeights) -> LayerWeights:
    """`layer` with its stacked experts in one form, as CUDA's fused MoE kernel takes them:
    where gate/up and down differ, each not already in the target form is requantized to it
    (gate/up's int4 with its group size; else int8 per channel)."""
    gate_up, down = layer.experts_gate_up, layer.experts_down
    if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)):
        return layer
    if gate_up.kind == down.kind:
        return layer
    mode, group = ("int4", gate_up.group_size) if gate_up.format == "int4" else ("int8", 0)
    target = (mode, group, mode == "int4")  # the kind quantize_experts makes (int4: with mins)

    def one_form(w: QuantizedWeight) -> QuantizedWeight:
        return w if w.kind == target else quantize_experts(w.dequantize_rows(), mode, group)

    return replace(layer, experts_gate_up=one_form(gate_up), experts_down=one_form(down))
