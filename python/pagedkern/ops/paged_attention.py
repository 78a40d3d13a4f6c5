"""paged_attention (decode): validation, the split-KV plan, then csrc/paged_attention.cu or the
reference.

Split-KV (flash-decoding): when batch x KV heads leaves SMs idle, each sequence's keys are cut into
splits of `split_size` tokens (a multiple of 64; the last split takes the rest), one CTA per split
writes its partial output and log-sum-exp to an fp32 workspace, and a second kernel merges them.
The plan depends only on host-side values (batch, heads, `max_seq_len`, SM count), never on
seq_lens' contents, so the launch needs no device sync and a fixed `max_seq_len` gives a fixed grid
(CUDA-graph capture: pass `max_seq_len` and a `workspace` of `workspace_size(...)` floats).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import support
from .arrays import (
    DTYPE_CODES,
    ArrayView,
    CheckedLayouts,
    check_contiguous,
    check_dtype,
    check_shape,
    common_device,
    layout_key,
    view,
)
from .index_checks import check_block_table_contents
from .launch import (
    check_indices,
    kernel_or_reference,
    kernel_variant,
    launch_context,
    on_launch_stream,
    reference_on_torch,
    sm_count,
)
from .paged_kv import (
    FP8_KV_DTYPE,
    attention_outputs,
    attention_views,
    check_attention_options,
    check_attention_views,
    check_kv_scales,
    check_out,
    check_rows_aligned,
    check_scale,
    check_sinks_layout,
    workspace_view,
)

SPLIT_ALIGN = 64  # split sizes are whole pipeline tiles (4096 / D tokens) for every D
MIN_SPLIT_TOKENS = 256  # shorter splits cost more in pipeline fill and merge than they save
MAX_SPLITS = 128
CTA_OVERHEAD_TOKENS = 64  # fixed cost of a CTA (prologue, merge of rows, epilogue) in tokens


@dataclass(frozen=True, slots=True)
class SplitPlan:
    num_splits: int
    split_size: int  # tokens per split; 0 when num_splits == 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _plan_for(num_splits: int, max_seq_len: int) -> SplitPlan:
    """The plan with at most num_splits splits of whole 64-token tiles covering max_seq_len."""
    if num_splits <= 1 or max_seq_len <= SPLIT_ALIGN:
        return SplitPlan(1, 0)
    size = _ceil_div(_ceil_div(max_seq_len, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    n = _ceil_div(max_seq_len, size)
    return SplitPlan(n, size) if n > 1 else SplitPlan(1, 0)


# The tensor-core kernel (csrc/paged_attention_mma.cuh): its head dims, the smallest GQA group
# "auto" gives it (below, most of its 8-head n dimension would be padding), heads per CTA.
MMA_HEAD_DIMS = (64, 128)
MMA_MIN_GROUP = 4
MMA_HEADS = 8
KERNEL_CODES = {"simt": 0, "mma": 1}  # csrc/paged_attention.h kPagedAttentionSimt / Mma


def decode_kernel(group: int, head_dim: int, variant: int | None = None) -> str:
    """The kernel a launch runs, 'simt' or 'mma', for PAGEDKERN_KERNELS=paged_attention:... (or
    `variant`, its code): auto takes mma for groups >= MMA_MIN_GROUP; D = 256 is simt always."""
    code = kernel_variant("paged_attention") if variant is None else variant
    if head_dim not in MMA_HEAD_DIMS or code == KERNEL_CODES["simt"]:
        return "simt"
    return "mma" if code == KERNEL_CODES["mma"] or group >= MMA_MIN_GROUP else "simt"


def ctas_per_kv_head(group: int, head_dim: int, kernel: str = "simt") -> int:
    """CTAs serving one KV head of one sequence (per split), as csrc/paged_attention.cu cuts a
    group of query heads. simt: units of 2 heads for even groups, else 1; up to kRows units per
    CTA (16 for D = 64, else 8). mma: 8 heads per CTA."""
    if kernel == "mma":
        return _ceil_div(group, MMA_HEADS)
    units = group // 2 if group % 2 == 0 else group
    return _ceil_div(units, 16 if head_dim == 64 else 8)


# Every input is an int and the search loops over up to MAX_SPLITS counts (~100 us in Python):
# a call site sees few distinct shapes, so each is planned once.
@functools.lru_cache(maxsize=1024)
def plan_splits(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    num_sms: int,
    num_splits: int | None = None,
    kernel: str = "simt",
) -> SplitPlan:
    """Number and size of the KV splits (host-side heuristic, no device values).

    CTAs without splitting: batch x KV heads x ctas_per_kv_head(group). If they fill the GPU
    (num_sms x 4 resident CTAs, 3 for D = 256), no split. Otherwise pick the split count that
    minimises waves x (tokens per split + a fixed per-CTA cost), with splits of at least 256
    tokens and at most 128 splits; ties go to fewer splits (less workspace and merge traffic).
    An explicit num_splits is honoured (rounded to whole 64-token tiles). kernel: 'simt' or
    'mma' (decode_kernel), which cut the group into different CTA counts; both use 48 KB of
    shared memory per CTA.
    """
    if num_splits is not None:
        return _plan_for(num_splits, max_seq_len)
    ctas = batch * num_kv_heads * ctas_per_kv_head(num_heads // num_kv_heads, head_dim, kernel)
    # Resident CTAs per SM: 48 KB of shared memory each (4 per H100/H200 SM); registers cap the
    # 256-thread CTAs of D = 256 at 3.
    slots = max(1, num_sms * (3 if head_dim == 256 else 4))
    most = min(MAX_SPLITS, max_seq_len // MIN_SPLIT_TOKENS)
    if ctas == 0 or ctas >= slots or most <= 1:
        return SplitPlan(1, 0)
    best, best_cost = SplitPlan(1, 0), None
    for n in range(1, most + 1):
        plan = _plan_for(n, max_seq_len)
        size = plan.split_size or max_seq_len
        cost = _ceil_div(ctas * plan.num_splits, slots) * (size + CTA_OVERHEAD_TOKENS)
        if best_cost is None or cost < best_cost:
            best, best_cost = plan, cost
    return best


def first_key(seq_len: int, window: int | None) -> int:
    """The oldest key a sequence's decode query sees (csrc paged_attention_first_key)."""
    return seq_len - window if window is not None and seq_len > window else 0


def split_bounds(plan: SplitPlan, seq_len: int, window: int | None = None) -> list[tuple[int, int]]:
    """Key ranges [start, end) of the splits that hold keys of a sequence, as the kernel cuts
    them: split s starts at first_key + s * split_size (first_key 0 without a window), the last
    split runs to seq_len."""
    if seq_len <= 0:
        return []
    lo = first_key(seq_len, window)
    if plan.num_splits == 1:
        return [(lo, seq_len)]
    bounds = []
    for s in range(min(plan.num_splits, _ceil_div(seq_len - lo, plan.split_size))):
        start = lo + s * plan.split_size
        last = s == plan.num_splits - 1
        bounds.append((start, seq_len if last else min(seq_len, start + plan.split_size)))
    return bounds


def workspace_size(batch: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of workspace a launch with num_splits > 1 needs (0 otherwise)."""
    return 0 if num_splits <= 1 else batch * num_heads * num_splits * (head_dim + 1)


def launch_parameters(
    qv: ArrayView,
    kc: ArrayView,
    bt: ArrayView,
    sl: ArrayView,
    ov: ArrayView,
    workspace: int,
    plan: SplitPlan,
    kernel: str,
    scale: float | None,
    k_scale: float | None,
    v_scale: float | None,
    device: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: int = 0,
) -> dict:
    """The kernel's parameters but the per-layer pointers (q, out, caches, lse) and the stream:
    what one launch passes and what a plan (ops/attention_plan.py) fixes for its runs (sinks:
    the [Hq] float32 sink logits' pointer, 0 for none)."""
    batch, num_heads, head_dim = qv.shape
    return dict(
        block_tables=bt.ptr,
        seq_lens=sl.ptr,
        workspace=workspace,
        q_stride=qv.strides[0],
        out_stride=ov.strides[0],
        block_table_stride=bt.strides[0],
        block_table_width=bt.shape[1],
        num_blocks=kc.shape[0],
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=kc.shape[1],
        head_dim=head_dim,
        block_size=kc.shape[2],
        num_splits=plan.num_splits,
        split_size=plan.split_size,
        scale=float(scale if scale is not None else head_dim**-0.5),
        dtype=DTYPE_CODES[qv.dtype],
        check_indices=check_indices(),
        device=device,
        variant=KERNEL_CODES[kernel],
        kv_fp8=kc.dtype == FP8_KV_DTYPE,
        k_scale=float(1.0 if k_scale is None else k_scale),
        v_scale=float(1.0 if v_scale is None else v_scale),
        window=int(sliding_window or 0),
        soft_cap=float(soft_cap or 0.0),
        sinks=sinks,
    )


def kernel_support(
    dtype: str, head_dim: int, block_size: int, kv_dtype: str | None = None
) -> support.KernelSupport:
    """(supported, reason): whether the CUDA kernel covers these arguments (ops/support.py)."""
    return support.paged_attention(dtype, head_dim, block_size, kv_dtype)


def _check_int(name: str, value, low: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise ValueError(f"{name} must be an int >= {low} or None, got {value!r}")


# Layouts whose checks passed: stage 1 the argument checks, stage 2 also the kernel's layout
# checks. Keyed by everything those checks read, so a hit skips only checks that would pass.
_CHECKED = CheckedLayouts()
_ARGS_CHECKED, _KERNEL_CHECKED = 1, 2


def plan_length(max_seq_len: int, sliding_window: int | None) -> int:
    """The most keys one sequence's splits cover: a window's at most (the kernel's splits start
    at the window's first key)."""
    return max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)


def _check_kernel_layout(views: list[ArrayView], wv: ArrayView | None) -> None:
    """What the kernel needs beyond the arguments' shapes: contiguous table rows and lengths,
    16-byte aligned query rows, caches and output, a contiguous float32 workspace on the same
    device (its size depends on the split plan: checked on every call)."""
    bt = views[3]
    if bt.shape[1] > 1 and bt.strides[1] != 1:
        raise ValueError(f"{bt.describe()}: rows must be contiguous")
    check_contiguous(views[4])
    check_rows_aligned(views[0])
    for cache in views[1:3]:
        if cache.ptr % 16:
            raise ValueError(f"{cache.describe()} must start at a 16-byte boundary")
    if len(views) > 5:
        check_out(views[0], views[5])
    if wv is not None:
        check_dtype(wv, ("float32",))
        check_contiguous(wv)
        common_device([*views, wv])
        if wv.ptr % 16:
            raise ValueError(f"{wv.describe()} must start at a 16-byte boundary")


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale=None,
    out=None,
    return_lse=False,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    workspace=None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks=None,
    stream=None,
):
    """Decode attention, one query per sequence: q [B, Hq, D]; caches [N, Hkv, bs, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (0 = padding, output zeros).
    Returns out [B, Hq, D] (and lse [B, Hq] float32 with return_lse).

    max_seq_len: a host-side bound on seq_lens for the split plan (default: the block table's
    width x block_size); a smaller bound stays correct (the last split takes the rest) but may
    be slow. num_splits: force the split count (1 = no split-KV). workspace: float32 CUDA array
    of at least workspace_size(B, Hq, D, plan.num_splits) elements, else allocated per call.
    Caches of q's dtype, or both float8_e4m3fn (E4M3, as reference.rope_and_cache writes them)
    with their dequantization scales k_scale / v_scale (default 1): attention over
    k_scale * K, v_scale * V (reference.paged_attention defines it).
    sliding_window, soft_cap, sinks: reference.attention.ATTENTION_OPTIONS, in both kernel
    variants (a window's splits start at its first key: older pages are never read).
    The CUDA kernel covers float16/bfloat16 q (with caches of q's dtype or fp8), D in
    {64, 128, 256} and power-of-two block sizes (`kernel_support`); other CUDA torch inputs
    run on the reference with a warning under the "auto" backend and raise
    KernelUnsupportedError under "cuda". The reference checks the
    indices' contents (ValueError naming the entry); the kernel checks them on the device with
    PAGEDKERN_CHECK_INDICES=1."""
    check_scale(scale)
    _check_int("max_seq_len", max_seq_len, 0)
    _check_int("num_splits", num_splits, 1)
    views = attention_views(q, k_cache, v_cache, block_tables, seq_lens, out)
    wv = None if workspace is None else view(workspace, "workspace")
    key = layout_key(views if wv is None else [*views, wv])
    checked = _CHECKED.level(key)
    qv, kc, bt = views[0], views[1], views[3]
    if checked < _ARGS_CHECKED:
        check_attention_views(views, None, fp8=True)
        check_shape(views[4], (qv.shape[0],))
        _CHECKED.passed(key, _ARGS_CHECKED)
    check_kv_scales(kc, k_scale, v_scale)
    sv = check_attention_options(qv, sliding_window, soft_cap, sinks)
    options = support.attention_options("paged_attention", sliding_window, soft_cap, sinks)
    decision = options or kernel_support(qv.dtype, qv.shape[2], kc.shape[2], kc.dtype)
    if not kernel_or_reference("paged_attention", views, decision):
        reference = reference_on_torch("paged_attention", views if sv is None else [*views, sv])
        check_block_table_contents(block_tables, seq_lens, kc.shape[0], kc.shape[2])
        return reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, return_lse, k_scale, v_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        )  # fmt: skip
    batch, num_heads, head_dim = qv.shape
    num_kv_heads, block_size = kc.shape[1], kc.shape[2]
    if checked < _KERNEL_CHECKED:
        _check_kernel_layout(views, wv)
        _CHECKED.passed(key, _KERNEL_CHECKED)
    check_sinks_layout(sv)
    module, device, handle = launch_context(views, stream)
    if max_seq_len is None:
        max_seq_len = bt.shape[1] * block_size
    num_sms = sm_count(module, device)
    kernel = decode_kernel(num_heads // num_kv_heads, head_dim)
    plan = plan_splits(
        batch, num_heads, num_kv_heads, head_dim, plan_length(max_seq_len, sliding_window),
        num_sms, num_splits, kernel,
    )  # fmt: skip
    # on the launch stream: the per-call workspace, freed on return, is reused only after the
    # kernel (launch.on_launch_stream)
    with on_launch_stream(views, device, handle):
        given = views[5] if out is not None else None
        out, ov, lse = attention_outputs(qv, out, return_lse, given)
        if plan.num_splits > 1:
            need = workspace_size(batch, num_heads, head_dim, plan.num_splits)
            if wv is None:  # allocated here; wv holds it alive until the launch is queued
                wv = workspace_view(None, qv, need, "float32", views)
            elif wv.numel < need:
                raise ValueError(f"{wv.describe()}: need {need} float32 elements, 16-byte aligned")
    module.paged_attention(
        out=ov.ptr,
        lse=view(lse, "lse").ptr if lse is not None else 0,
        q=qv.ptr,
        k_cache=kc.ptr,
        v_cache=views[2].ptr,
        stream=handle,
        **launch_parameters(
            qv, kc, bt, views[4], ov, wv.ptr if plan.num_splits > 1 else 0, plan, kernel,
            scale, k_scale, v_scale, device, sliding_window, soft_cap,
            0 if sv is None else sv.ptr,
        ),
    )  # fmt: skip
    return (out, lse) if return_lse else out
