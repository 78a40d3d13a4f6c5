"""fused_moe's grouped GEMMs on wgmma + TMA (csrc/moe_gemm_sm90.cu): the moe_gemm:sm90_wgmma
variant (PAGEDKERN_KERNELS), not yet verified on GPU. Which calls take it and the extension's
entry point; ops/moe.py routes and groups the tokens (at this variant's 64-row tile) and makes
the buffers as for the default kernels.

Selected on a GPU other than sm_90 it is refused: the extension raises a ValueError naming the
GPU's architecture. Calls whose operands TMA cannot address (H or I not a multiple of 8,
hidden rows or weights not 16-byte aligned) run the default mma.sync kernels instead."""

from __future__ import annotations

from .arrays import ArrayView
from .variants import selected

VARIANT = "sm90_wgmma"  # of the op moe_gemm (ops/variants.py)
TILE_M = 64  # its row tile: one wgmma.m64 per CTA (moe_align groups at 64)


def takes(hv: ArrayView, gv: ArrayView, dv: ArrayView, hidden_stride: int) -> bool:
    """Whether this fused_moe call runs the wgmma kernels: the variant selected, H and I
    multiples of 8 (TMA's 16-byte strides) and 16-byte aligned hidden rows and weights."""
    if selected("moe_gemm") != VARIANT:
        return False
    hidden, inter = dv.shape[1], dv.shape[2]
    aligned = all(v.ptr % 16 == 0 for v in (hv, gv, dv))
    return hidden % 8 == 0 and inter % 8 == 0 and hidden_stride % 8 == 0 and aligned
