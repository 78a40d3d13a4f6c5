"""Runs one scheduled iteration on the model: the flattened batch and its metadata from the
requests' state, one forward pass, and sampling of the rows whose prompt is fully computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..model import KVCache, LlamaModel, SequenceChunk, layout_batch
from .cuda_graphs import DecodeGraphs
from .request import Request


@dataclass(slots=True)
class StepResult:
    """Sampled token per request that completed its uncomputed tokens this step, and those rows'
    fp32 logits (for tracing), in the same order."""

    requests: list[Request]
    token_ids: list[int]
    logits: torch.Tensor | None


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        cuda_graphs: bool = False,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.graphs = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, kv_cache, max_num_seqs, max_model_len)
            if self.device.type == "cuda":
                self.graphs.capture()

    def run(self, entries: list[tuple[Request, int]]) -> StepResult:
        # Prefill chunks first, then one-token rows: the layout the model's metadata expects.
        ordered = [e for e in entries if e[1] > 1] + [e for e in entries if e[1] == 1]
        chunks = [
            SequenceChunk(
                r.ids_between(r.num_computed_tokens, r.num_computed_tokens + n),
                r.num_computed_tokens,
                r.block_table,
            )
            for r, n in ordered
        ]
        rows = [i for i, (r, n) in enumerate(ordered) if r.num_computed_tokens + n == r.num_tokens]
        layout = layout_batch(chunks, self.kv_cache.block_size, logits_rows=rows)
        if self.graphs is not None and layout.num_prefills == 0 and len(rows) == len(chunks):
            logits = self.graphs.run(layout)  # every row a decode that samples: replay a graph
        else:
            tp = self.model.tp  # TP rank 0: broadcasts the step; a failure in it is fatal
            with tp.fatal_errors():
                input_ids, meta = tp.upload(layout, self.device, logits=bool(rows))
                if not rows:  # only mid-prompt chunks: fill the cache, skip the LM head
                    self.model.hidden_states(input_ids, meta, self.kv_cache)
                    return StepResult([], [], None)
                logits = self.model(input_ids, meta, self.kv_cache)
        requests = [ordered[i][0] for i in rows]
        ids = self.sample(logits, requests)
        return StepResult(requests, ids, logits)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One id per row, with each request's parameters; the step offset is the number of
        tokens it has generated, so its draws do not depend on its batch neighbours. The
        parameters go up in one copy; the ids come back in one."""
        params = [r.params for r in requests]
        fields = (
            torch.tensor([r.seed for r in requests], dtype=torch.int64),
            torch.tensor([len(r.output_ids) for r in requests], dtype=torch.int64),
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int32),
        )
        packed = torch.cat([f.view(torch.uint8) for f in fields])  # int64s first: aligned views
        if logits.device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(logits.device, non_blocking=True)
        seeds, offsets, temperature, top_p, top_k = (
            part.view(f.dtype)
            for part, f in zip(
                packed.split([f.numel() * f.element_size() for f in fields]), fields, strict=True
            )
        )
        return ops.sample(logits, temperature, top_p, top_k, seeds, offsets).tolist()
