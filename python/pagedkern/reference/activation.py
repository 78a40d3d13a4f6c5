"""The gated activations: SwiGLU (silu_and_mul) and GeGLU (gelu_tanh_and_mul)."""

from __future__ import annotations

import torch


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(x[..., :d]) * x[..., d:] for x of shape [..., 2d]; fp32 math, rounded once."""
    d = x.shape[-1] // 2
    xf = x.float()
    y = (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = gelu(x[..., :d], approximate="tanh") * x[..., d:] for x of shape [..., 2d]; fp32
    math, rounded once (Gemma's GeGLU, HF's gelu_pytorch_tanh)."""
    d = x.shape[-1] // 2
    xf = x.float()
    y = (torch.nn.functional.gelu(xf[..., :d], approximate="tanh") * xf[..., d:]).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
