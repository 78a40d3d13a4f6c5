"""Synthetic models: seeded random weights of the right shapes for any ModelConfig (the presets
include the reference document's ~8B shape), so engines and benchmarks run at realistic scale
without a download. The scale of each tensor keeps activations O(1) through every layer, so
attention and sampling see non-degenerate distributions."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .weights import LayerWeights, LlamaWeights


def synthetic_weights(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LlamaWeights:
    """Random weights for `config`, identical for the same (seed, device type)."""
    device = torch.device(device)
    meta = device.type == "meta"  # shapes only: no memory, no random numbers
    generator = None if meta else torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        if meta:
            return torch.empty(shape, dtype=dtype, device=device)
        t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        return (t.mul_(std).add_(mean)).to(dtype)

    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size

    def norm() -> torch.Tensor:  # near 1, but not exactly, so a missing norm shows
        return randn(h, std=0.1, mean=1.0)

    def bias(rows: int, present: bool) -> torch.Tensor | None:
        return randn(rows, std=0.1) if present else None

    layers = [
        LayerWeights(
            input_norm=norm(),
            qkv=randn(config.qkv_size, h, std=h**-0.5),
            o=randn(h, config.q_size, std=config.q_size**-0.5),
            post_norm=norm(),
            gate_up=randn(2 * i, h, std=h**-0.5),
            down=randn(h, i, std=i**-0.5),
            qkv_bias=bias(config.qkv_size, config.qkv_bias),
            o_bias=bias(h, config.o_bias),
            gate_up_bias=bias(2 * i, config.mlp_bias),
            down_bias=bias(h, config.mlp_bias),
            q_norm=randn(config.head_dim, std=0.1, mean=1.0) if config.qk_norm else None,
            k_norm=randn(config.head_dim, std=0.1, mean=1.0) if config.qk_norm else None,
            attn_out_norm=norm() if config.sandwich_norms else None,
            mlp_out_norm=norm() if config.sandwich_norms else None,
        )
        for _ in range(config.num_layers)
    ]
    for n, layer in enumerate(layers):  # (drawn after the dense weights: their values unchanged)
        if config.is_moe_layer(n):
            _moe_layer(config, layer, randn)
        if config.qk_norm_whole:  # (OLMoE) one norm weight per q / k projection element
            layer.q_norm = randn(config.q_size, std=0.1, mean=1.0)
            layer.k_norm = randn(config.kv_size, std=0.1, mean=1.0)
    # Unit-scale logits from a unit-RMS final hidden state, tied or not.
    embed = randn(v, h, std=h**-0.5)
    lm_head = embed if config.tie_word_embeddings else randn(v, h, std=h**-0.5)
    return LlamaWeights(embed, layers, norm(), lm_head)


def _moe_layer(config: ModelConfig, layer: LayerWeights, randn) -> None:
    """Turn `layer` into a mixture-of-experts layer: router, stacked experts, the shared expert
    (or no dense MLP)."""
    h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
    s = config.shared_expert_size
    layer.router = randn(e, h, std=h**-0.5)
    layer.experts_gate_up = randn(e, 2 * i, h, std=h**-0.5)
    layer.experts_down = randn(e, h, i, std=i**-0.5)
    layer.gate_up = randn(2 * s, h, std=h**-0.5) if s else None
    layer.down = randn(h, s, std=s**-0.5) if s else None
    layer.shared_gate = randn(1, h, std=h**-0.5) if s else None
