"""RoPE frequencies of a model (plain, linear- or Llama-3-scaled) and its cos|sin table."""

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
    elif scaling is not None:
        raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64).cpu()
    return inv_freq


def rope_table(
    config: ModelConfig,
    max_positions: int,
    device: torch.device | str,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32 cos|sin table for rope_and_cache."""
    inv_freq = rope_inv_freq(config, freq_factors)
    table = reference.cos_sin_cache(config.head_dim, max_positions, inv_freq=inv_freq)
    return table.to(device)
