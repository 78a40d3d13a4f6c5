"""Weight-only quantization of a model's runtime weights: every layer's linear weights, the
stacked experts of MoE layers and the LM head, each put in its mode."""

from __future__ import annotations

from dataclasses import fields

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
    mode), others are requantized from their floats ('none': dequantized to fp32). A tied
    embedding follows the head (its rows are dequantized at lookup). A MoE layer's stacked
    experts follow the layers' mode (convert_experts)."""

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
        return w.float() if mode == "none" else quantize(w, mode, group_size)

    def plain(w: Linear) -> torch.Tensor:
        return w.dequantize_rows() if isinstance(w, QuantizedWeight) else w

    def convert_experts(layer: LayerWeights) -> dict[str, Linear | None]:
        """The stacked experts in `mode`: both GEMMs or neither (they stay float where an
        in-features count does not divide into the mode's blocks)."""
        pair = {"experts_gate_up": layer.experts_gate_up, "experts_down": layer.experts_down}
        if layer.experts_gate_up is None:
            return pair
        if mode == "none" or not all(
            quantizable(w.shape[-1], mode, group_size) for w in pair.values()
        ):
            return {name: plain(w).float() for name, w in pair.items()}
        if all(kept(w, mode) for w in pair.values()) and len({w.kind for w in pair.values()}) == 1:
            return pair
        target = (mode, group_size if mode == "int4" else 0)  # (ops.fused_moe: one form)
        return {
            name: w
            if isinstance(w, QuantizedWeight) and (w.format, w.group_size) == target
            else quantize_experts(plain(w), mode, group_size)
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
