"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels (per layer: two norms, four GEMMs, RoPE +
cache write, attention, SiLU); at small batch sizes launching them costs more than running them.
The forward pass of a pure-decode batch is therefore captured once per batch size of a ladder
(1, 2, 4, 8, then steps of 16 up to max_num_seqs) and replayed with the batch padded to the next
size: padding rows have sequence length 0 (attention reads nothing, writes zeros) and slot -1 (no
cache write). Inputs live in one static int32 device buffer at fixed offsets, filled each step
from one pinned host buffer with one copy; block tables are padded to the widest a sequence can
need, so the attention launch (split plan included) is the same for every replay: each size's
attention is planned once, by the eager warm-up before its capture, into workspaces its
StepAttention owns for the graph's lifetime (model/step_attention.py), and the graph captures
the layers' runs only. Steps that carry a prefill chunk replay piecewise graphs instead
(engine/piecewise_graphs.py).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from ..model import AttentionMetadata, BatchLayout, KVCache, LlamaModel
from ..model.step_attention import StepAttention
from ..ops import launch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes |= set(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class StaticInputs:
    """A step's int32 inputs at fixed offsets of one device buffer (what a graph reads),
    written through one host buffer (pinned on CUDA) and uploaded with one copy."""

    def __init__(self, lengths: list[int], device: torch.device):
        pinned = device.type == "cuda"
        self._host = torch.zeros(sum(lengths), dtype=torch.int32, pin_memory=pinned)
        self._device = torch.zeros(sum(lengths), dtype=torch.int32, device=device)
        self.host = self._host.split(lengths)
        self.device = self._device.split(lengths)

    def upload(self) -> None:
        # The previous step's copy has completed: its sampled ids were read back (a sync)
        # before this step began, so the host buffer is free to rewrite.
        self._device.copy_(self._host, non_blocking=True)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, max_num_seqs: int, max_model_len: int):
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.width = -(-max_model_len // kv_cache.block_size)  # blocks of the longest sequence
        b, m = self.max_batch, self.width
        # a hybrid cache's per-kind tables: groups 1..'s (tables, slots) after the others
        groups = kv_cache.groups
        self.num_groups = 0 if groups is None else groups.num_groups - 1
        # ids, positions, slot_mapping, cu_seqlens, block_tables, seq_lens, logits_indices
        lengths = [b, b, b, b + 1, b * m, b, b] + [b * m, b] * self.num_groups
        self._inputs = StaticInputs(lengths, model.device)
        self._h, self._d = self._inputs.host, self._inputs.device
        self._h[3].copy_(torch.arange(b + 1, dtype=torch.int32))  # one row per sequence
        self._h[6].copy_(torch.arange(b, dtype=torch.int32))
        self._np = [h.numpy() for h in self._h]  # numpy views: a step writes no torch op
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        # per size: ids, metadata (views of the static buffer) and its planned attention,
        # which lives as long as the graph (the graph's launches hold its workspaces)
        self._static: dict[int, tuple[torch.Tensor, AttentionMetadata, StepAttention]] = {}

    def bucket(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def _meta(self, size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        ids, positions, slots, cu, tables, seq_lens, logits_indices, *groups = self._d
        meta = AttentionMetadata(
            positions=positions[:size],
            slot_mapping=slots[:size],
            cu_seqlens=cu[: size + 1],
            block_tables=tables[: size * self.width].view(size, self.width),
            seq_lens=seq_lens[:size],
            logits_indices=logits_indices[:size],
            num_prefills=0,
            num_prefill_tokens=0,
            max_query_len=1,
            max_seq_len=self.width * self.kv_cache.block_size,
            group_block_tables=tuple(
                t[: size * self.width].view(size, self.width) for t in groups[0::2]
            ),
            group_slot_mappings=tuple(g[:size] for g in groups[1::2]),
        )
        return ids[:size], meta

    def static_step(self, size: int) -> tuple[torch.Tensor, AttentionMetadata, StepAttention]:
        """ids, metadata and attention plans of the graph of `size` (made once: the first
        forward over them plans, every later one, and the capture, only runs)."""
        step = self._static.get(size)
        if step is None:
            ids, meta = self._meta(size)
            step = self._static[size] = (ids, meta, StepAttention(meta))
        return step

    def _fill(self, layout: BatchLayout | None) -> None:
        """Write a decode batch (or, with None, all padding) into the host buffer and upload it."""
        ids, positions, slots, _, tables, seq_lens, _, *groups = self._np
        n = 0 if layout is None else len(layout.seq_lens)
        if n:
            ids[:n] = layout.input_ids
            positions[:n] = layout.positions
            seq_lens[:n] = layout.seq_lens
            written = [(layout.block_tables, layout.slot_mapping), *layout.groups]
            for (table, slot), (static_table, static_slot) in zip(
                written, [(tables, slots), *zip(groups[0::2], groups[1::2])], strict=True
            ):
                static_slot[:n] = slot
                rows = static_table.reshape(self.max_batch, self.width)
                rows[:n, : layout.width] = np.reshape(table, (n, layout.width))
        ids[n:] = 0
        positions[n:] = 0
        for static_slot in (slots, *groups[1::2]):
            static_slot[n:] = -1  # padding rows write nothing to the cache
        seq_lens[n:] = 0  # ... and read nothing from it
        self._inputs.upload()

    def capture(self) -> None:
        """Capture one graph per batch size, largest first so the smaller ones share its memory
        pool. Each is warmed up eagerly first (cuBLAS workspaces, lazy kernel loading)."""
        self._fill(None)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):
            ids, meta, attention = self.static_step(size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # the first plans the attention (its workspaces included)
                    self.model(ids, meta, self.kv_cache, attention)
            torch.cuda.current_stream().wait_stream(side)
            attention.frozen = True  # the graph captures runs only; a plan here would raise
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self.model(ids, meta, self.kv_cache, attention)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, layout: BatchLayout) -> torch.Tensor:
        """Logits [n, vocab] of a pure-decode batch of n <= max_batch sequences."""
        n = len(layout.seq_lens)
        if layout.num_prefills or layout.width > self.width or n > self.max_batch:
            raise ValueError("not a decode batch these graphs can run")
        size = self.bucket(n)
        self._fill(layout)
        if size in self._graphs:
            self._graphs[size].replay()
            launch.record_launch("graph_replay")
            return self._logits[size][:n]
        # not captured (CPU, or capture skipped): the same path eagerly, the size's plans
        # made by its first step and run by every later one, as a replay runs them
        ids, meta, attention = self.static_step(size)
        return self.model(ids, meta, self.kv_cache, attention)[:n]
