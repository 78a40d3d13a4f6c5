"""The CPU backend's silu_and_mul: reference.silu_and_mul's function (the same fp32 products, the
same bits) as one SiLU and one in-place multiply on fp32 rows, without the reference's dtype
round trips; other dtypes and `out` run the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import reference


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(x[..., :d]) * x[..., d:] for x of shape [..., 2d]."""
    if x.dtype != torch.float32 or out is not None:
        return reference.silu_and_mul(x, out)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])
