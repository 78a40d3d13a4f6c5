"""Mixed steps (prefill chunks + decodes) replayed from CUDA graphs in pieces (vLLM v1's way).

A step that carries a prefill chunk cannot replay a decode graph: flash_prefill's and
paged_attention's launches depend on the batch's structure (how many prefills, their lengths,
the split plan). Everything else in a layer works row by row, so the forward is cut at
attention, and for each token count T of a ladder (16, 32, 64, ... doubling, and
max_num_batched_tokens) the work between two attentions is captured as one graph on static
buffers padded to T rows:

  piece 0         embedding, layer 0's input norm and QKV GEMM                      -> qkv
  piece i (0<i<L) layer i-1's tail (O GEMM, add + norm, gate/up GEMM, SiLU x mul, down GEMM,
                  add + layer i's input norm), layer i's QKV GEMM                   -> qkv
  piece L         layer L-1's tail with the final norm, the LM head on the logit rows -> logits

Attention (rope_and_cache, flash_prefill, paged_attention: model._attention) runs eagerly
between the pieces on the first n rows of the same static buffers, with the step's own
metadata, planned once per step (model/step_attention.py): exactly the launches, shapes and
split plan of the eager forward. Padding rows n..T
(id 0, position 0, slot -1) go through the pieces only; every piece op is row-wise (GEMM rows,
norms, SiLU), so they never reach a real row, and nothing reads them back. The LM head runs on
min(T, max_num_seqs) rows (the most a step without speculation samples), padded with row 0.

Host launches per mixed step: L + 1 replays and 2-3 attention launches per layer, instead of
~10 per layer. Costs: the T - n padding rows' GEMM work (T < 2n from 16 tokens up; small
steps, launch-bound anyway, pad to 16), one copy of the QKV output per piece into the static
buffer (T x qkv_size elements, read + written), and memory: the static buffers (T x (hidden +
qkv + q) activations, min(T, max_num_seqs) x vocab fp32 logits) plus the graph pool, which
keeps the largest piece's temporaries (gate/up output of T rows) for the graphs' lifetime.

Outputs: the same kernels on the same real rows, except that the GEMMs see M = T rows (the LM
head its padded row count) instead of n. cuBLAS promises bit-identical results for the same
call, not across M: its heuristics pick tiles and split-K by shape, so a row's last bits can
depend on T; this CPU's BLAS likewise takes a small-M path below ~7-16 rows. Bit-identical to
eager where the library's rows do not depend on M, within rounding elsewhere
(tests/test_piecewise_graphs.py shows both; on a GPU, a replay equals the uncaptured static
path bit for bit: tests/test_piecewise_graphs_gpu.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from ..model import BatchLayout, KVCache, LlamaModel
from ..model.attention_metadata import AttentionMetadata
from ..model.linear import linear
from ..model.step_attention import StepAttention
from ..ops import launch
from .cuda_graphs import StaticInputs

Piece = Callable[[], torch.Tensor | None]
"""One piece's work on the static buffers; the last returns the logits."""
PieceRecorder = Callable[[Piece], Piece]
"""Turns a piece into its replay (CudaGraphRecorder; tests record Python calls instead)."""

SMALLEST = 16  # ladder start: below it a mixed step is padded, whatever its size


def piecewise_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """The token counts captured: 16, 32, 64, ... below the maximum, then the maximum."""
    sizes, t = [], SMALLEST
    while t < max_num_batched_tokens:
        sizes.append(t)
        t *= 2
    return [*sizes, max_num_batched_tokens]


class CudaGraphRecorder:
    """Captures pieces as CUDA graphs sharing one memory pool, each warmed up eagerly first on
    a side stream (cuBLAS workspaces, lazy kernel loading). Every tensor that crosses a piece
    boundary (the logits included) is a static buffer allocated outside the pool, and each
    graph's temporaries are dead when it ends, so graphs may replay in any order."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream()

    def __call__(self, piece: Piece) -> Piece:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for _ in range(2):
                piece()
        torch.cuda.current_stream().wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = piece()

        def replay() -> torch.Tensor | None:
            graph.replay()
            return out

        return replay


class PiecewiseGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = piecewise_token_sizes(max_num_batched_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_num_seqs = max_num_seqs
        self.width = -(-max_model_len // kv_cache.block_size)  # blocks of the longest sequence
        t, b, cfg, device = self.max_tokens, max_num_seqs, model.local, model.device
        # ids and logit rows at fixed offsets (the pieces read them); the rest only the eager
        # attention reads, laid out as the step's own metadata: one host buffer, one copy.
        # ids, logits_indices, positions, slot_mapping, cu_seqlens, block_tables, seq_lens,
        # then a hybrid cache's per-kind (block_tables, slot_mapping) of groups 1..
        groups = kv_cache.groups
        self.num_groups = 0 if groups is None else groups.num_groups - 1
        lengths = [t, min(t, b), t, t, b + 1, b * self.width, b]
        self._inputs = StaticInputs(lengths + [b * self.width, t] * self.num_groups, device)
        self._h = [part.numpy() for part in self._inputs.host]
        self._d = self._inputs.device
        # The activations that cross piece boundaries.
        dtype = model.dtype
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(t, cfg.qkv_size, dtype=dtype, device=device)
        self.attn = torch.zeros(t, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        # One logits buffer for every size (per-size outputs would hold sizes x rows x vocab).
        self.logits = torch.zeros(min(t, b), cfg.vocab_size, device=device)
        self._replays: dict[int, list[Piece]] = {}

    def bucket(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def logit_rows(self, size: int) -> int:
        """LM-head rows of the graphs of `size` tokens."""
        return min(size, self.max_num_seqs)

    def covers(self, layout: BatchLayout) -> bool:
        n, rows = len(layout.input_ids), len(layout.logits_indices)
        return (
            n <= self.max_tokens
            and len(layout.seq_lens) <= self.max_num_seqs
            and layout.width <= self.width
            and 0 < rows <= self.logit_rows(self.bucket(n))
        )

    def _fill(self, layout: BatchLayout, size: int) -> AttentionMetadata:
        """Upload the step (padded to `size` rows) and return its attention metadata: views of
        the static buffer holding the same values as the eager path's."""
        ids, rows, positions, slots, cu, tables, seq_lens, *groups = self._h
        n, b, w = len(layout.input_ids), len(layout.seq_lens), layout.width
        num_rows = len(layout.logits_indices)
        ids[:n], ids[n:size] = layout.input_ids, 0
        rows[:num_rows], rows[num_rows : self.logit_rows(size)] = layout.logits_indices, 0
        positions[:n], positions[n:size] = layout.positions, 0
        slots[:n], slots[n:size] = layout.slot_mapping, -1  # padding rows write nothing
        cu[: b + 1] = layout.cu_seqlens
        tables[: b * w] = layout.block_tables
        seq_lens[:b] = layout.seq_lens
        for (table, slot), static_table, static_slot in zip(
            layout.groups, groups[0::2], groups[1::2], strict=True
        ):
            static_slot[:n], static_slot[n:size] = slot, -1
            static_table[: b * w] = table
        self._inputs.upload()
        _, d_rows, d_positions, d_slots, d_cu, d_tables, d_seq_lens, *d_groups = self._d
        p = layout.num_prefills
        return AttentionMetadata(
            positions=d_positions[:n],
            slot_mapping=d_slots[:n],
            cu_seqlens=d_cu[: b + 1],
            block_tables=d_tables[: b * w].view(b, w),
            seq_lens=d_seq_lens[:b],
            logits_indices=d_rows[:num_rows],
            num_prefills=p,
            num_prefill_tokens=int(layout.cu_seqlens[p]),
            max_query_len=layout.max_query_len,
            max_seq_len=int(np.max(layout.seq_lens)),
            group_block_tables=tuple(t[: b * w].view(b, w) for t in d_groups[0::2]),
            group_slot_mappings=tuple(g[:n] for g in d_groups[1::2]),
        )

    def pieces(self, size: int) -> list[Piece]:
        """The L + 1 pieces of a step padded to `size` tokens, on views of the static buffers;
        the model's own methods (LlamaModel.embed_and_norm, layer_tail) do the math."""
        model, layers = self.model, self.model.weights.layers
        ids = self._d[0][:size]
        residual, qkv, attn = (b[:size] for b in (self.residual, self.qkv, self.attn))
        logit_rows = self._d[1][: self.logit_rows(size)]
        logits = self.logits[: self.logit_rows(size)]

        def first() -> None:
            h, embedded = model.embed_and_norm(ids, layers[0].input_norm)
            residual.copy_(embedded)
            qkv.copy_(linear(h, layers[0].qkv, layers[0].qkv_bias))

        def between(i: int) -> Piece:
            def piece() -> None:
                h, _ = model.layer_tail(attn, residual, layers[i - 1], model.next_norm(i - 1))
                qkv.copy_(linear(h, layers[i].qkv, layers[i].qkv_bias))

            return piece

        def last() -> torch.Tensor:
            h, _ = model.layer_tail(attn, residual, layers[-1], model.next_norm(len(layers) - 1))
            return logits.copy_(model.compute_logits(h[logit_rows]))  # TP = 1: no gather

        return [first, *(between(i) for i in range(1, len(layers))), last]

    def capture(self, record: PieceRecorder | None = None) -> None:
        """Record every piece of every size, largest first (on CUDA the smaller graphs then
        reuse the larger ones' pool memory). record: default CudaGraphRecorder."""
        record = record or CudaGraphRecorder()
        for size in reversed(self.sizes):
            self._replays[size] = [record(piece) for piece in self.pieces(size)]
        self.residual.zero_()  # warm-ups accumulated into it; the first piece overwrites it
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, layout: BatchLayout) -> torch.Tensor:
        """Logits [len(layout.logits_indices), vocab] of a step that covers() accepts."""
        if not self.covers(layout):
            raise ValueError("not a step these piecewise graphs can run")
        n, size = len(layout.input_ids), self.bucket(len(layout.input_ids))
        meta = self._fill(layout, size)
        replays = self._replays.get(size)
        pieces = replays or self.pieces(size)  # not captured (CPU): the same path, eagerly
        scales = self.kv_cache.scales or [None] * len(self.kv_cache.layers)
        layers = self.model.weights.layers
        attention = StepAttention(meta)  # planned by the first layer, run by every layer
        groups = self.kv_cache.groups  # a hybrid cache: each layer reads its group's tables
        metas = [meta.for_group(g) for g in range(1 + self.num_groups)]
        logits = None
        for i, piece in enumerate(pieces):
            if i:  # attention of layer i - 1, eagerly, on the step's real rows
                k_cache, v_cache = self.kv_cache.layers[i - 1]
                qkv, attn = self.qkv[:n], self.attn[:n]
                layer_meta = metas[groups.layer_group[i - 1]] if groups else meta
                self.model._attention(
                    qkv, layers[i - 1], layer_meta, k_cache, v_cache, attn, scales[i - 1],
                    i - 1, attention,
                )  # fmt: skip
            logits = piece()
            if replays:
                launch.record_launch("graph_replay")
        assert logits is not None
        return logits[: len(layout.logits_indices)]
