"""One step's attention, planned once and run by every layer (ops/attention_plan.py's wrappers).

The model builds a StepAttention per forward pass from the step's AttentionMetadata; each
layer calls it with its q, caches and output. Layers share a plan when they share what a plan
fixes: the attention options (scale, sliding window, soft-cap, sinks), the fp8 dequantization
scales and the block tables. A Llama step has one such kind, Gemma 2/3 two (sliding and global
layers); an fp8 cache has one per layer (each layer's calibrated scales), as have per-layer
sinks. The first layer of a kind plans
its PrefillAttention (rows [0, num_prefill_tokens)) and DecodeAttention (the rest); every layer
then only runs: on CUDA a layout compare and the launch, no planning, no allocation. Decode
plans of one window need the same split-KV workspace, so they share one.

On CPU tensors under the reference backend a run calls the one-shot op with the planned
arguments. Under the CPU backend every row of a step is one C++ kernel call a layer
(StepKernelAttention, the default); under cpu_attention:tiles the decode rows get their own plan
(ops/cpu/decode_attention.py): each layer's float32 K/V copy of the rows, kept to the next step
(the model's DecodeCopies) and appended to there instead of gathered again; the layers pass
their new k/v rows for it.
Two cases keep the one-shot ops: shadow mode (its wrappers replace `pagedkern.ops` entries,
which the one-shot calls go through) and
PAGEDKERN_KERNELS=attention_plan:off (the path before plan/run, kept selectable until a GPU
has run this one).

CUDA graphs (engine/cuda_graphs.py) keep one StepAttention per captured batch size: planned
by the eager warm-up on the static metadata buffers, frozen for the capture (a plan inside it
raises), and alive as long as the graph, whose launches hold its workspaces' addresses. The
plan depends only on host values fixed per size (batch, the block tables' width) and on the
static buffers' addresses, so a replay needs no new plan.
"""

from __future__ import annotations

import torch

from .. import ops
from ..ops import launch, shadow
from ..ops.attention_plan import DecodeAttention, PrefillAttention
from ..ops.cpu import attention_kernel
from ..ops.cpu.attention_kernel import StepKernelAttention
from ..ops.cpu.decode_attention import CpuDecodeAttention, DecodeCopies, DecodeRows
from ..ops.variants import selected
from .attention_metadata import AttentionMetadata


class StepAttention:
    """The attention of one forward pass over `meta`; call it per layer (see the module doc)."""

    def __init__(self, meta: AttentionMetadata, copies: DecodeCopies | None = None) -> None:
        """copies: the CPU backend's decode K/V copies kept between steps (the model's); this
        step begins with it (None: a copy lives for the step only)."""
        self.meta = meta
        self._copies = copies
        if copies is not None:
            copies.begin_step()
        self._rows: dict[int, DecodeRows] = {}  # id(block tables) -> the CPU decode rows
        # kind -> (prefill plan or None, decode plan or None)
        self._plans: dict[tuple, tuple | StepKernelAttention] = {}
        self._workspaces: dict[int | None, object] = {}  # window -> shared split-KV workspace
        self.one_shot = selected("attention_plan") == "off"
        self.frozen = False  # set while a CUDA graph captures: planning would be captured

    @property
    def num_plans(self) -> int:
        """Kinds planned so far (one per kind of layer that ran)."""
        return len(self._plans)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        sinks: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> None:
        """Attention of one layer's rows into `out`: flash_prefill on the prefill rows,
        paged_attention on the decode rows. sinks: the layer's sink logits (a plan reads them
        by address: layers share a plan only with the same tensor). block_tables: this layer's
        (a hybrid cache's group table; default meta.block_tables), likewise by identity. k, v:
        the layer's new k/v rows as rope_and_cache cached them (the CPU decode plan appends
        them to its copy; None: read back from the cache)."""
        meta = self.meta
        tables = meta.block_tables if block_tables is None else block_tables
        key = (scale, sliding_window, soft_cap, k_scale, v_scale, id(sinks), id(tables))
        plans = None if self.one_shot or shadow.shadowing() else self._plans.get(key)
        if plans is None:
            options = dict(
                scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                v_scale=v_scale, sinks=sinks,
            )  # fmt: skip
            if self.one_shot or shadow.shadowing():
                self._one_shot(q, k_cache, v_cache, out, tables, options)
                return
            plans = self._plan(key, q, k_cache, v_cache, out, tables, options)
        if isinstance(plans, StepKernelAttention):
            plans.run(q, k_cache, v_cache, out)
            return
        prefill, decode = plans
        rows = meta.num_prefill_tokens
        if prefill is not None:
            prefill.run(q[:rows], k_cache, v_cache, out[:rows])
        if isinstance(decode, CpuDecodeAttention):
            if rows and k is not None:
                k, v = k[rows:], v[rows:]
            decode.run(q[rows:] if rows else q, k_cache, v_cache, out[rows:] if rows else out, k, v)
        elif decode is not None:
            if rows:
                decode.run(q[rows:], k_cache, v_cache, out[rows:])
            else:
                decode.run(q, k_cache, v_cache, out)

    def _plan(self, key, q, k_cache, v_cache, out, tables, options) -> tuple:
        if self.frozen:
            raise RuntimeError(
                "attention planned during a CUDA-graph capture: run the step eagerly first "
                "(the warm-up plans it)"
            )
        meta = self.meta
        if self._on_cpu_backend(k_cache) and attention_kernel.applies(
            k_cache, q.shape[2]
        ):  # every row in one call
            self._plans[key] = kernel = StepKernelAttention(
                meta.cu_seqlens, meta.seq_lens, tables, q.shape[0], options
            )
            return kernel
        p, rows = meta.num_prefills, meta.num_prefill_tokens
        prefill = decode = None
        if p:
            prefill = PrefillAttention()
            prefill.plan(
                q[:rows], k_cache, v_cache, meta.cu_seqlens[: p + 1], tables[:p],
                meta.seq_lens[:p], out[:rows], **options,
            )  # fmt: skip
        if rows < q.shape[0] and self._cpu_decode_plan(options, k_cache):
            decode = CpuDecodeAttention(
                self._decode_rows(tables[p:], k_cache, tables), options["scale"],
                options["soft_cap"], options["k_scale"], options["v_scale"],
            )  # fmt: skip
        elif rows < q.shape[0]:
            window = options["sliding_window"]
            decode = DecodeAttention(workspace=self._workspaces.get(window))
            decode.plan(
                q[rows:], k_cache, v_cache, tables[p:], meta.seq_lens[p:], out[rows:], **options
            )
            if decode.workspace is not None:
                self._workspaces.setdefault(window, decode.workspace)
        self._plans[key] = plans = (prefill, decode)
        return plans

    def _on_cpu_backend(self, k_cache: torch.Tensor) -> bool:
        """Whether CPU tensors run under the CPU backend ("cpu" or "auto")."""
        return launch.on_cpu_backend(k_cache.device)

    def _cpu_decode_plan(self, options: dict, k_cache: torch.Tensor) -> bool:
        """Whether the decode rows run the tiles' decode plan (the CPU backend, options it
        computes, every row a written sequence)."""
        if not self._on_cpu_backend(k_cache):
            return False
        meta, rows = self.meta, self.meta.num_prefill_tokens
        return not CpuDecodeAttention.declines(
            options["sliding_window"], options["sinks"], meta.seq_lens[meta.num_prefills :],
            meta.slot_mapping[rows:],
        )  # fmt: skip

    def _decode_rows(self, tables, k_cache, whole_tables) -> DecodeRows:
        """The decode rows over `tables` (one per block table the step's layers read: planned
        by the first layer reading it, shared by every kind of layer that does)."""
        found = self._rows.get(id(whole_tables))
        if found is None:
            meta, p = self.meta, self.meta.num_prefills
            copies = self._copies if self._copies is not None else DecodeCopies()
            found = self._rows[id(whole_tables)] = DecodeRows(
                copies, len(self._rows), tables, meta.seq_lens[p:],
                meta.positions[meta.num_prefill_tokens :], k_cache.shape[2],
            )  # fmt: skip
        return found

    def _one_shot(self, q, k_cache, v_cache, out, tables, options) -> None:
        """The ops called per layer, planning inside each call (shadow mode, attention_plan:off)."""
        meta = self.meta
        options = {k: v for k, v in options.items() if v is not None}
        p, rows = meta.num_prefills, meta.num_prefill_tokens
        if p:
            ops.flash_prefill(  # fp8 too: the kernel reads E4M3 pages
                q[:rows], k_cache, v_cache, meta.cu_seqlens[: p + 1], tables[:p],
                meta.seq_lens[:p], out=out[:rows], **options,
            )  # fmt: skip
        if rows < q.shape[0]:
            ops.paged_attention(
                q[rows:], k_cache, v_cache, tables[p:], meta.seq_lens[p:], out=out[rows:],
                **options,
            )  # fmt: skip
