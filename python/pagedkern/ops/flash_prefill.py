"""flash_prefill (causal varlen prefill over the paged cache): validation, then the CUDA kernels
(csrc/flash_prefill*.cu) or the reference.

Two kernel paths (csrc/flash_prefill.cu dispatches): path 1, mma.sync + cp.async, runs on every
GPU from sm_80 on; path 2, wgmma + TMA with warp specialisation, on sm_90 when the block size
allows TMA page loads (a multiple of 8 dividing 128, or a multiple of 128). The environment
variable PAGEDKERN_FLASH_PREFILL_PATH (pagedkern/envs.py) picks one: "auto" (default), "sm80"
(path 1 everywhere, e.g. to test it on Hopper) or "sm90" (path 2, an error where it cannot
run). An fp8 (float8_e4m3fn) K/V cache with float16/bfloat16 q runs path 1 on every GPU (path 2
does not read fp8). Work is scheduled on the device from cu_seqlens_q and seq_lens (never read
back to the host), into a small int32 workspace allocated per call unless `workspace=` passes
one (CUDA-graph capture).
"""

from __future__ import annotations

import dataclasses

from .. import envs
from . import support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    ArrayView,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_shape,
    common_device,
    view,
)
from .index_checks import check_block_table_contents, check_query_bounds
from .launch import (
    check_indices,
    kernel_or_reference,
    kernel_variant,
    launch_context,
    on_launch_stream,
    reference_on_torch,
)
from .paged_kv import (
    attention_outputs,
    attention_views,
    check_attention_options,
    check_attention_views,
    check_kv_scales,
    check_rows_aligned,
    check_scale,
    check_sinks_layout,
    workspace_view,
)

PATH_ENV = "PAGEDKERN_FLASH_PREFILL_PATH"
# csrc/flash_prefill.h FlashPrefillPath, exported as _C.FLASH_PREFILL_PATHS (a test compares them)
PATHS = {"auto": 0, "sm80": 1, "sm90": 2}
PATH_NAMES = {code: name for name, code in PATHS.items()}
FP8_CACHE_DTYPE = "float8_e4m3fn"  # E4M3 pages (torch.float8_e4m3fn)


def launch_parameters(
    qv: ArrayView,
    kc: ArrayView,
    cu: ArrayView,
    bt: ArrayView,
    sl: ArrayView,
    ov: ArrayView,
    workspace: int,
    scale: float | None,
    k_scale: float | None,
    v_scale: float | None,
    device: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: int = 0,
) -> dict:
    """The kernels' parameters but the per-layer pointers (q, out, caches, lse) and the stream:
    what one launch passes and what a plan (ops/attention_plan.py) fixes for its runs. k_scale
    is folded into the softmax scale, v_scale into the output; sinks: the [Hq] float32 sink
    logits' pointer (0: none). A call with an option runs path 1 (path 2's options kernel only
    under the flash_prefill:sm90_options variant, not yet verified on GPU)."""
    total, num_heads, head_dim = qv.shape
    path = requested_path()
    return dict(
        cu_seqlens_q=cu.ptr,
        block_tables=bt.ptr,
        seq_lens=sl.ptr,
        workspace=workspace,
        q_stride=qv.strides[0] if total > 1 else num_heads * head_dim,
        out_stride=ov.strides[0] if total > 1 else num_heads * head_dim,
        block_table_stride=bt.strides[0],
        block_table_width=bt.shape[1],
        num_blocks=kc.shape[0],
        total_q=total,
        batch=cu.shape[0] - 1,
        num_heads=num_heads,
        num_kv_heads=kc.shape[1],
        head_dim=head_dim,
        block_size=kc.shape[2],
        scale=float(scale if scale is not None else head_dim**-0.5)
        * (1.0 if k_scale is None else k_scale),
        out_scale=float(1.0 if v_scale is None else v_scale),
        dtype=DTYPE_CODES[qv.dtype],
        fp8_cache=kc.dtype == FP8_CACHE_DTYPE,
        path=PATHS[path],
        strict=path != "auto",
        check_indices=check_indices(),
        device=device,
        variant=kernel_variant("flash_prefill"),
        window=int(sliding_window or 0),
        soft_cap=float(soft_cap or 0.0),
        sinks=sinks,
    )


def requested_path() -> str:
    """The kernel path PAGEDKERN_FLASH_PREFILL_PATH asks for ("auto" when unset)."""
    return envs.ENV[PATH_ENV].get()


def kernel_path(
    device: int, head_dim: int, block_size: int, path: str | None = None, fp8_cache: bool = False
) -> str:
    """The path ("sm80" or "sm90") a call takes on `device` for this head dim, block size and
    cache dtype (16-byte aligned arrays), given a requested path (default: the environment's)."""
    from .._extension import require

    code = require().flash_prefill_path(
        device=device,
        head_dim=head_dim,
        block_size=block_size,
        fp8_cache=fp8_cache,
        path=PATHS[path or requested_path()],
    )
    return PATH_NAMES[code]


def kernel_support(dtype: str, head_dim: int, kv_dtype: str | None = None) -> support.KernelSupport:
    """(supported, reason): whether the CUDA kernels cover these arguments (ops/support.py)."""
    return support.flash_prefill(dtype, head_dim, kv_dtype)


def check_arguments(
    q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, out, scale, k_scale, v_scale
):
    """(q's view, the argument views [q, k_cache, v_cache, block_tables, seq_lens, (out,)
    cu_seqlens_q]): every check of the arguments whichever path runs them (the op, a plan)."""
    check_scale(scale)
    cu = view(cu_seqlens_q, "cu_seqlens_q")
    check_dtype(cu, ("int32",))
    check_ndim(cu, 1)
    if cu.shape[0] < 1:
        raise ValueError(f"{cu.describe()} must hold at least one entry")
    qv, views = _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu.shape[0] - 1, out)
    views.append(cu)
    common_device(views)
    check_kv_scales(views[1], k_scale, v_scale)
    return qv, views


def check_kernel_layout(views: list[ArrayView]) -> None:
    """What the kernels need beyond the arguments' shapes (views as check_arguments returns
    them): contiguous cu_seqlens_q, lengths and table rows, 16-byte aligned query rows and
    caches."""
    qv, kc, vc, bt, sl, cu = *views[:5], views[-1]
    check_contiguous(cu)
    check_contiguous(sl)
    if bt.shape[1] > 1 and bt.strides[1] != 1:
        raise ValueError(f"{bt.describe()}: rows must be contiguous")
    check_rows_aligned(qv)
    for cache in (kc, vc):
        if cache.ptr % 16:
            raise ValueError(f"{cache.describe()} must start at a 16-byte boundary")


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, batch: int, out):
    """(q's view, the argument views): the shared attention checks, plus an fp8 cache's own
    (both caches float8_e4m3fn; q any float dtype here: the reference reads any, the kernel's
    support covers float16/bfloat16 q). The shared checks want caches in q's dtype: an fp8
    pair passes its own checks first (shape, layout, GQA: messages name its true dtype), then
    the rest on views relabelled to q's dtype."""
    views = attention_views(q, k_cache, v_cache, block_tables, seq_lens, out)
    qv, kc, vc = views[:3]
    if FP8_CACHE_DTYPE not in (kc.dtype, vc.dtype):
        check_attention_views(views, batch)
        return qv, views
    for cache in (kc, vc):
        if cache.dtype != FP8_CACHE_DTYPE:
            raise TypeError(f"{cache.describe()}: both caches must be {FP8_CACHE_DTYPE}")
    check_dtype(qv, FLOAT_DTYPES)
    check_ndim(qv, 3)
    for cache in (kc, vc):
        check_ndim(cache, 4)
        check_shape(cache, (None, kc.shape[1], None, qv.shape[2]))
        check_contiguous(cache)
    check_shape(vc, kc.shape)
    if kc.shape[1] == 0 or qv.shape[1] % kc.shape[1]:
        raise ValueError(
            f"{qv.describe()}: query heads must be a multiple of the KV heads of {kc.describe()}"
        )
    relabelled = [dataclasses.replace(c, dtype=qv.dtype) for c in (kc, vc)]
    check_attention_views([qv, *relabelled, *views[3:]], batch)
    return qv, views


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
    k_scale: float | None = None,
    v_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks=None,
    workspace=None,
    stream=None,
):
    """Causal varlen prefill over the paged cache: q [total_q, Hq, D] holds B query chunks
    delimited by cu_seqlens_q [B+1] int32; seq_lens [B] int32 counts each sequence's keys in the
    cache (prefix + chunk). Returns out [total_q, Hq, D] (and lse [total_q, Hq] float32).

    The CUDA kernels cover float16/bfloat16 q with caches of q's dtype or float8_e4m3fn (an
    fp8 cache with float32 q: the reference, like float32 q with a float32 cache), and
    D in {64, 128, 256} (256: path 1, 16-bit caches; `kernel_support`); k_scale, v_scale:
    dequantization scales of an fp8 cache's stored K and V, None meaning 1 (as in
    paged_attention and rope_and_cache; defined in reference.flash_prefill; the kernel folds
    them into the softmax scale and the output).
    Other CUDA torch inputs run on the reference with a warning under the "auto" backend and raise
    KernelUnsupportedError under "cuda". The reference checks the indices' contents; the kernels
    never read lengths on the host and check them (cu_seqlens_q rising from 0 to total_q,
    chunk length <= seq_lens[b] <= table capacity, block ids in the cache) only in the
    PAGEDKERN_CHECK_INDICES=1 debug mode.
    sliding_window, soft_cap, sinks: reference.attention.ATTENTION_OPTIONS, in path 1 (a call
    that sets one runs there, on Hopper too unless PAGEDKERN_KERNELS=flash_prefill:sm90_options
    selects path 2's options kernel; KV tiles before a window are never loaded), for
    16-bit caches (with an fp8 cache such a call runs the reference).
    workspace: int32 CUDA array of at least _C.flash_prefill_workspace_ints(total_q, B) entries,
    else allocated per call."""
    qv, views = check_arguments(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, out, scale, k_scale, v_scale
    )
    cu, kc = views[-1], views[1]
    sv = check_attention_options(qv, sliding_window, soft_cap, sinks)
    options = support.attention_options(
        "flash_prefill", sliding_window, soft_cap, sinks, kv_dtype=kc.dtype
    )
    decision = options or kernel_support(qv.dtype, qv.shape[2], kc.dtype)
    if not kernel_or_reference("flash_prefill", views, decision):
        reference = reference_on_torch("flash_prefill", views if sv is None else [*views, sv])
        check_block_table_contents(block_tables, seq_lens, kc.shape[0], kc.shape[2])
        check_query_bounds(cu_seqlens_q, seq_lens, qv.shape[0])
        return reference.flash_prefill(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            block_tables,
            seq_lens,
            scale,
            out,
            return_lse,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sinks=sinks,
        )
    kc, vc, bt, sl = views[1:5]
    total, batch = qv.shape[0], cu.shape[0] - 1
    check_kernel_layout(views)
    check_sinks_layout(sv)
    module, device, handle = launch_context(views, stream)
    need = int(module.flash_prefill_workspace_ints(total_q=total, batch=batch))
    # on the launch stream: the per-call work list, freed on return, is reused only after the
    # kernels (launch.on_launch_stream)
    with on_launch_stream(views, device, handle):
        out, ov, lse = attention_outputs(qv, out, return_lse)
        wv = workspace_view(workspace, qv, need, "int32", views)
    module.flash_prefill(
        out=ov.ptr,
        lse=view(lse, "lse").ptr if lse is not None else 0,
        q=qv.ptr,
        k_cache=kc.ptr,
        v_cache=vc.ptr,
        stream=handle,
        **launch_parameters(
            qv, kc, cu, bt, sl, ov, wv.ptr, scale, k_scale, v_scale, device, sliding_window,
            soft_cap, 0 if sv is None else sv.ptr,
        ),
    )  # fmt: skip
    return (out, lse) if return_lse else out
