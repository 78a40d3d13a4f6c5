"""Attention in two halves, as FlashInfer's wrappers are: `plan` once per batch, `run` per layer.

    decode = DecodeAttention()
    decode.plan(q, k_cache[0], v_cache[0], block_tables, seq_lens, out)   # once per batch
    for layer in range(num_layers):
        decode.run(q_of(layer), k_cache[layer], v_cache[layer], out)      # per layer

`plan` does everything the one-shot op does on the host: the argument checks, the kernel choice,
the split-KV plan (decode), a workspace the object owns, and the kernel's launch parameters,
which it keeps in an extension object (`_C.PagedAttentionLaunch` / `_C.FlashPrefillLaunch`).
`run` then reads four pointers and the stream, checks that the layer's tensors have the planned
layout (shape, strides, dtype, device: a cheap tuple compare, so a wrong tensor is a ValueError,
never an out-of-bounds access) and launches: no allocation, no device sync, no planning, so a
user can capture a step built from runs in a CUDA graph. The block tables, lengths and
cu_seqlens the plan saw are read by every run: refill them in place for the next batch of the
same shape, or plan again.

The fast path takes torch tensors; other arrays (CuPy, __cuda_array_interface__ objects) and CPU
tensors (the reference) run through the one-shot op with the planned arguments. One plan serves
one stream at a time (its workspace is reused by every run).
"""

from __future__ import annotations

from .arrays import check_shape
from .flash_prefill import (
    PATH_NAMES,
)
from .flash_prefill import (
    check_arguments as check_prefill_arguments,
)
from .flash_prefill import (
    check_kernel_layout as check_prefill_layout,
)
from .flash_prefill import (
    flash_prefill as flash_prefill_op,
)
from .flash_prefill import (
    kernel_support as prefill_support,
)
from .flash_prefill import (
    launch_parameters as prefill_launch_parameters,
)
from .launch import count_launches, kernel_or_reference, launch_context, record_launch, sm_count
from .paged_attention import (
    _check_kernel_layout,
    decode_kernel,
    launch_parameters,
    plan_length,
    plan_splits,
    workspace_size,
)
from .paged_attention import (
    kernel_support as decode_support,
)
from .paged_attention import (
    paged_attention as paged_attention_op,
)
from .paged_kv import (
    attention_views,
    check_attention_options,
    check_attention_views,
    check_kv_scales,
    check_out,
    check_scale,
    check_sinks_layout,
    workspace_view,
)
from .support import attention_options


def _layout(t) -> tuple | None:
    """What a run must share with the planned tensors (torch tensors only; None otherwise)."""
    if not hasattr(t, "data_ptr"):
        return None
    return t.shape, t.stride(), t.dtype, t.device


class _Plan:
    """What DecodeAttention and PrefillAttention share: the planned layout of (q, k_cache,
    v_cache, out), the launch object, and the one-shot fallback."""

    _NAMES = ("q", "k_cache", "v_cache", "out")
    _OP = ""  # the op a run launches (count_launches)

    def __init__(self) -> None:
        self._launch = None  # the extension's launch object; None: the one-shot op path
        self._layouts: tuple | None = None
        self._stream_of = None
        self._workspace = None

    def _fast(self, q, k_cache, v_cache, out) -> bool:
        """Whether run() may launch directly: a kernel plan and tensors of the planned layout
        (a ValueError naming the first that differs)."""
        if self._launch is None:
            return False
        tensors = (q, k_cache, v_cache, out)
        layouts = tuple(_layout(t) for t in tensors)
        if layouts != self._layouts:
            for name, got, want in zip(self._NAMES, layouts, self._layouts, strict=True):
                if got != want:
                    raise ValueError(
                        f"{name}: shape, strides, dtype and device must be the planned "
                        f"{want}, got {got}; plan again for a new layout"
                    )
        for name, t in zip(self._NAMES, tensors, strict=True):
            if t.data_ptr() % 16:
                raise ValueError(f"{name} must start at a 16-byte boundary for the kernel")
        return True

    @property
    def workspace(self):
        """The workspace the plan owns (None: its kernel needs none, or the reference runs)."""
        return self._workspace

    def _use_kernel(self, views, decision) -> bool:
        """kernel_or_reference for the plan, which is no launch: its count is dropped (every
        run counts one, as every one-shot call does)."""
        with count_launches():
            return kernel_or_reference(self._OP, views, decision)

    def _planned_layouts(self, q, k_cache, v_cache, out) -> tuple | None:
        layouts = tuple(_layout(t) for t in (q, k_cache, v_cache, out))
        return None if None in layouts else layouts

    def _current_stream(self, q, stream) -> int:
        if stream is not None:
            return int(getattr(stream, "cuda_stream", stream))
        if q.device.type != "cuda":
            return 0  # (the CPU emulator of the kernels)
        import torch

        return torch.cuda.current_stream(q.device).cuda_stream


class DecodeAttention(_Plan):
    """paged_attention (one query per sequence) planned once per batch: see the module's doc.
    plan() takes the same arguments as ops.paged_attention, with `out` required (runs write into
    it); run() takes a layer's q, caches and out, of the planned layout."""

    _OP = "paged_attention"

    def __init__(self, workspace=None) -> None:
        """workspace: a float32 CUDA array for split-KV partials that the plan uses instead of
        allocating its own (a plan that needs more raises)."""
        super().__init__()
        self._user_workspace = workspace
        self._args: dict | None = None

    def plan(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        *,
        scale: float | None = None,
        max_seq_len: int | None = None,
        num_splits: int | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks=None,
    ) -> None:
        """sliding_window, soft_cap, sinks: as ops.paged_attention's, for every run (sinks is
        read by every run: keep it alive and refill it in place, or plan again)."""
        check_scale(scale)
        views = attention_views(q, k_cache, v_cache, block_tables, seq_lens, out)
        check_attention_views(views, None, fp8=True)
        qv, kc, vc, bt, sl, ov = views
        check_shape(sl, (qv.shape[0],))
        check_kv_scales(kc, k_scale, v_scale)
        sv = check_attention_options(qv, sliding_window, soft_cap, sinks)
        batch, num_heads, head_dim = qv.shape
        num_kv_heads, block_size = kc.shape[1], kc.shape[2]
        if max_seq_len is None:
            max_seq_len = bt.shape[1] * block_size
        self._args = dict(
            block_tables=block_tables, seq_lens=seq_lens, scale=scale, max_seq_len=max_seq_len,
            num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        )  # fmt: skip
        self._launch = self._layouts = None
        options = attention_options("paged_attention", sliding_window, soft_cap, sinks)
        decision = options or decode_support(qv.dtype, head_dim, block_size, kc.dtype)
        layouts = self._planned_layouts(q, k_cache, v_cache, out)
        if layouts is None or not self._use_kernel(views, decision):
            return  # the one-shot op with these arguments, at every run
        _check_kernel_layout(views, None)
        check_sinks_layout(sv)
        module, device, _ = launch_context(views)
        kernel = decode_kernel(num_heads // num_kv_heads, head_dim)
        split = plan_splits(
            batch, num_heads, num_kv_heads, head_dim, plan_length(max_seq_len, sliding_window),
            sm_count(module, device), num_splits, kernel,
        )  # fmt: skip
        workspace_ptr = 0
        if split.num_splits > 1:
            need = workspace_size(batch, num_heads, head_dim, split.num_splits)
            wv = workspace_view(self._user_workspace, qv, need, "float32", views)
            self._workspace = wv.obj  # owned: alive as long as the plan
            workspace_ptr = wv.ptr
        params = launch_parameters(
            qv, kc, bt, sl, ov, workspace_ptr, split, kernel, scale, k_scale, v_scale, device,
            sliding_window, soft_cap, 0 if sv is None else sv.ptr,
        )  # fmt: skip
        self._launch = module.PagedAttentionLaunch(**params)
        self._layouts = layouts

    def run(self, q, k_cache, v_cache, out, *, stream=None):
        """Attention of one layer into `out` (returned)."""
        if self._args is None:
            raise RuntimeError("DecodeAttention.run before plan")
        if not self._fast(q, k_cache, v_cache, out):
            a = self._args
            return paged_attention_op(
                q, k_cache, v_cache, a["block_tables"], a["seq_lens"], a["scale"], out,
                max_seq_len=a["max_seq_len"], num_splits=a["num_splits"],
                workspace=self._workspace, k_scale=a["k_scale"], v_scale=a["v_scale"],
                sliding_window=a["sliding_window"], soft_cap=a["soft_cap"], sinks=a["sinks"],
                stream=stream,
            )  # fmt: skip
        record_launch("paged_attention")
        self._launch.run(
            q=q.data_ptr(), out=out.data_ptr(), k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(), lse=0, stream=self._current_stream(q, stream),
        )  # fmt: skip
        return out


class PrefillAttention(_Plan):
    """flash_prefill (causal varlen prefill over the paged cache) planned once per batch: see
    the module's doc. plan() takes the same arguments as ops.flash_prefill, with `out`
    required; the plan owns the int32 workspace the kernel schedules its tiles in."""

    _OP = "flash_prefill"

    def __init__(self) -> None:
        super().__init__()
        self._args: dict | None = None
        self.path: str | None = None  # the kernel path the last fast run took

    def plan(
        self,
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        seq_lens,
        out,
        *,
        scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks=None,
    ) -> None:
        """sliding_window, soft_cap, sinks: as ops.flash_prefill's, for every run."""
        qv, views = check_prefill_arguments(
            q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, out, scale, k_scale,
            v_scale,
        )  # fmt: skip
        sv = check_attention_options(qv, sliding_window, soft_cap, sinks)
        kc, bt, sl, ov, cu = views[1], views[3], views[4], views[5], views[6]
        self._args = dict(
            cu_seqlens_q=cu_seqlens_q, block_tables=block_tables, seq_lens=seq_lens,
            scale=scale, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, sinks=sinks,
        )  # fmt: skip
        self._launch = self._layouts = None
        layouts = self._planned_layouts(q, k_cache, v_cache, out)
        options = attention_options(
            "flash_prefill", sliding_window, soft_cap, sinks, kv_dtype=kc.dtype
        )
        decision = options or prefill_support(qv.dtype, qv.shape[2], kc.dtype)
        if layouts is None or not self._use_kernel(views, decision):
            return
        check_prefill_layout(views)
        check_out(qv, ov)
        check_sinks_layout(sv)
        total, batch = qv.shape[0], cu.shape[0] - 1
        module, device, _ = launch_context(views)
        need = int(module.flash_prefill_workspace_ints(total_q=total, batch=batch))
        wv = workspace_view(None, qv, need, "int32", views)
        self._workspace = wv.obj
        params = prefill_launch_parameters(
            qv, kc, cu, bt, sl, ov, wv.ptr, scale, k_scale, v_scale, device, sliding_window,
            soft_cap, 0 if sv is None else sv.ptr,
        )  # fmt: skip
        self._launch = module.FlashPrefillLaunch(**params)
        self._layouts = layouts

    def run(self, q, k_cache, v_cache, out, *, stream=None):
        """Prefill attention of one layer into `out` (returned)."""
        if self._args is None:
            raise RuntimeError("PrefillAttention.run before plan")
        if not self._fast(q, k_cache, v_cache, out):
            a = self._args
            return flash_prefill_op(
                q, k_cache, v_cache, a["cu_seqlens_q"], a["block_tables"], a["seq_lens"],
                a["scale"], out, k_scale=a["k_scale"], v_scale=a["v_scale"],
                sliding_window=a["sliding_window"], soft_cap=a["soft_cap"], sinks=a["sinks"],
                stream=stream,
            )  # fmt: skip
        record_launch("flash_prefill")
        taken = self._launch.run(
            q=q.data_ptr(), out=out.data_ptr(), k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(), lse=0, stream=self._current_stream(q, stream),
        )  # fmt: skip
        self.path = PATH_NAMES.get(taken)
        return out
