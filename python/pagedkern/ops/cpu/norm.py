"""The CPU backend's RMSNorm and fused residual-add + RMSNorm: torch's rms_norm (one call a norm
instead of the reference's six elementwise passes), the statistics in fp32 and the result rounded
once to x's dtype, as the reference defines them."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None
) -> torch.Tensor:
    """reference.rms_norm's function."""
    if x.dtype == torch.float32:
        y = torch.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        y = torch.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fused_add_rms_norm's function: residual += x (in fp32, rounded once), then x =
    rms_norm(residual), both in place."""
    if residual.dtype == torch.float32 and x.dtype == torch.float32:
        residual.add_(x)
    else:
        residual.copy_(x.float() + residual.float())
    x.copy_(rms_norm(residual, weight, eps))
    return x, residual
