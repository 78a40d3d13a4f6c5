"""flash_prefill (causal varlen prefill over the paged cache): validation, then the CUDA kernels
(csrc/flash_prefill*.cu) or the reference.

Two kernel paths (csrc/flash_prefill.cu dispatches): path 1, mma.sync + cp.async, runs on every
GPU from sm_80 on; path 2, wgmma + TMA with warp specialisation, on sm_90 when the block size
allows TMA page loads (a multiple of 8 dividing 128, or a multiple of 128). The environment
variable PAGEDKERN_FLASH_PREFILL_PATH picks one: "auto" (default), "sm80" (path 1 everywhere,
e.g. to test it on Hopper) or "sm90" (path 2, an error where it cannot run). Work is scheduled on
the device from cu_seqlens_q and seq_lens (never read back to the host), into a small int32
workspace allocated per call unless `workspace=` passes one (CUDA-graph capture).
"""

from __future__ import annotations

import os

from .arrays import (
    DTYPE_CODES,
    ArrayView,
    check_contiguous,
    check_dtype,
    check_ndim,
    common_device,
    view,
)
from .launch import kernel_variant, launch_context, reference_on_torch, use_reference
from .paged_kv import (
    attention_outputs,
    check_attention_args,
    check_rows_aligned,
    check_scale,
    workspace_view,
)

KERNEL_DTYPES = ("float16", "bfloat16")
KERNEL_HEAD_DIMS = (64, 128)
PATH_ENV = "PAGEDKERN_FLASH_PREFILL_PATH"
PATHS = {"auto": 0, "sm80": 1, "sm90": 2}  # csrc/flash_prefill.h FlashPrefillPath
PATH_NAMES = {code: name for name, code in PATHS.items()}


def requested_path() -> str:
    """The kernel path PAGEDKERN_FLASH_PREFILL_PATH asks for ("auto" when unset)."""
    name = os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
    if name not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {name!r}")
    return name


def kernel_path(device: int, head_dim: int, block_size: int, path: str | None = None) -> str:
    """The path ("sm80" or "sm90") a call takes on `device` for this head dim and block size
    (16-byte aligned arrays), given a requested path (default: the environment's)."""
    from .._extension import require

    code = require().flash_prefill_path(
        device, head_dim, block_size, PATHS[path or requested_path()]
    )
    return PATH_NAMES[code]


def _kernel_supports(qv: ArrayView) -> bool:
    return qv.dtype in KERNEL_DTYPES and qv.shape[2] in KERNEL_HEAD_DIMS


def flash_prefill(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    block_tables,
    seq_lens,
    scale=None,
    out=None,
    return_lse=False,
    *,
    workspace=None,
    stream=None,
):
    """Causal varlen prefill over the paged cache: q [total_q, Hq, D] holds B query chunks
    delimited by cu_seqlens_q [B+1] int32; seq_lens [B] int32 counts each sequence's keys in the
    cache (prefix + chunk). Returns out [total_q, Hq, D] (and lse [total_q, Hq] float32).

    The CUDA kernels cover float16/bfloat16 and D in {64, 128}; other torch inputs run on the
    reference. They trust the lengths (never read on the host): cu_seqlens_q non-decreasing up to
    total_q, seq_lens[b] >= the chunk length, block tables covering seq_lens[b] keys.
    workspace: int32 CUDA array of at least _C.flash_prefill_workspace_ints(total_q, B) entries,
    else allocated per call."""
    check_scale(scale)
    cu = view(cu_seqlens_q, "cu_seqlens_q")
    check_dtype(cu, ("int32",))
    check_ndim(cu, 1)
    if cu.shape[0] < 1:
        raise ValueError(f"{cu.describe()} must hold at least one entry")
    qv, views = check_attention_args(
        q, k_cache, v_cache, block_tables, seq_lens, cu.shape[0] - 1, out
    )
    views.append(cu)
    common_device(views)
    if use_reference(views) or not _kernel_supports(qv):
        reference = reference_on_torch("flash_prefill", views)
        return reference.flash_prefill(
            q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, out, return_lse
        )
    kc, vc, bt, sl = views[1:5]
    total, num_heads, head_dim = qv.shape
    batch = cu.shape[0] - 1
    check_contiguous(cu)
    check_contiguous(sl)
    if bt.shape[1] > 1 and bt.strides[1] != 1:
        raise ValueError(f"{bt.describe()}: rows must be contiguous")
    check_rows_aligned(qv)
    for cache in (kc, vc):
        if cache.ptr % 16:
            raise ValueError(f"{cache.describe()} must start at a 16-byte boundary")
    path = requested_path()
    module, device, handle = launch_context(views, stream)
    out, ov, lse = attention_outputs(qv, out, return_lse)
    need = int(module.flash_prefill_workspace_ints(total, batch))
    wv = workspace_view(workspace, qv, need, "int32", views)
    module.flash_prefill(
        ov.ptr,
        view(lse, "lse").ptr if lse is not None else 0,
        qv.ptr,
        kc.ptr,
        vc.ptr,
        cu.ptr,
        bt.ptr,
        sl.ptr,
        wv.ptr,
        qv.strides[0] if total > 1 else num_heads * head_dim,
        ov.strides[0] if total > 1 else num_heads * head_dim,
        bt.strides[0],
        kc.shape[0],
        total,
        batch,
        num_heads,
        kc.shape[1],
        head_dim,
        kc.shape[2],
        float(scale if scale is not None else head_dim**-0.5),
        DTYPE_CODES[qv.dtype],
        PATHS[path],
        path != "auto",
        device,
        handle,
        kernel_variant("flash_prefill"),
    )
    return (out, lse) if return_lse else out
