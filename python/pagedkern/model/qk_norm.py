"""QK-norm: q and k RMS-normalised before RoPE. Qwen3 and Gemma 3 norm each head over its
head_dim, a weight shared by the heads; OLMoE norms the whole q projection and the whole k
projection of a token at once, a weight per element.

The per-head norm is fused into rope_and_cache (it normalises in place, then rotates) where it
can be; fp8 calibration reads the normalised k before the cache write, so there it runs here.
"""

from __future__ import annotations

import torch

from .. import ops
from .config import ModelConfig
from .weights import LayerWeights


def qk_norms(
    q: torch.Tensor, k: torch.Tensor, layer: LayerWeights, cfg: ModelConfig, fuse: bool
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(q, k, the norm arguments left to rope_and_cache) for q [T, Hq, D] and k [T, Hkv, D]
    of `layer`; fuse: whether a per-head norm may be left to rope_and_cache."""
    if cfg.qk_norm_whole:
        q = _whole_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = _whole_norm(k, layer.k_norm, cfg.rms_norm_eps)
        return q, k, {}
    if layer.q_norm is None:
        return q, k, {}
    if fuse:
        return q, k, dict(q_norm=layer.q_norm, k_norm=layer.k_norm, norm_eps=cfg.rms_norm_eps)
    return (
        _head_norm(q, layer.q_norm, cfg.rms_norm_eps),
        _head_norm(k, layer.k_norm, cfg.rms_norm_eps),
        {},
    )


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head ([T, H, D] -> a new contiguous [T, H, D]); heads of the fused QKV
    output are not rows of one stride, so they are normed as a [T * H, D] copy."""
    tokens, heads, dim = x.shape
    return ops.rms_norm(x.reshape(tokens * heads, dim), weight, eps).view(tokens, heads, dim)


def _whole_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over all heads of each token at once ([T, H, D] -> a new [T, H, D]; weight
    [H * D]), as OLMoE norms the whole q and k projections."""
    tokens, heads, dim = x.shape
    return ops.rms_norm(x.reshape(tokens, heads * dim), weight, eps).view(tokens, heads, dim)
