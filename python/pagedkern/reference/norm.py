"""RMSNorm and the fused residual-add + RMSNorm of every transformer layer."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out = x * rsqrt(mean(x^2, -1) + eps) * weight, in fp32, rounded once to x.dtype.

    x: [..., H] float32/float16/bfloat16; weight: [H], same dtype. Returns `out` if given.
    """
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    y = (xf * inv_rms * weight.float()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual = T(x + residual) (sum in fp32); x = rms_norm(residual, weight, eps).

    The norm is taken of the rounded residual that is stored, so afterwards
    x == rms_norm(residual) exactly. x, residual: [..., H], same dtype; weight: [H].
    Returns (x, residual).
    """
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    x.copy_(rms_norm(residual, weight, eps))
    return x, residual
