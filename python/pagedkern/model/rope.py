"""RoPE frequencies of a model (plain, linear-, Llama-3- or YaRN-scaled) and its cos|sin table."""

from __future__ import annotations

import math

import torch

from .. import reference
from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[head_dim/2] float64 inverse frequencies. `freq_factors` divides them (GGUF rope_freqs,
    llama.cpp's spelling of Llama 3 scaling)."""
    d = config.head_dim
    inv_freq = config.rope_theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif scaling is not None and scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, config.rope_theta, d, scaling)
    elif scaling is not None:
        raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64).cpu()
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, base: float, d: int, scaling) -> torch.Tensor:
    """YaRN as transformers computes it (_compute_yarn_parameters): the frequencies of the
    dimensions below `low` kept, above `high` divided by factor, a linear ramp between; low and
    high where a frequency turns beta_fast / beta_slow times over the original context."""
    old_len = scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor), 1 otherwise."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def rope_table(
    config: ModelConfig,
    max_positions: int,
    device: torch.device | str,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32 cos|sin table for rope_and_cache."""
    inv_freq = rope_inv_freq(config, freq_factors)
    table = reference.cos_sin_cache(config.head_dim, max_positions, inv_freq=inv_freq)
    factor = rope_attention_factor(config)
    if factor != 1.0:
        table = table * factor
    return table.to(device)
