"""Runs one scheduled iteration on the model: the flattened batch and its metadata from the
requests' state, one forward pass, and sampling of the rows whose prompt is fully computed.
Speculating requests feed their last token and proposals as one-token decode rows
(model/attention_metadata.verification_rows), get logits for every row, and are verified
(engine/speculative/verify.py) instead of sampled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .. import ops
from ..model import KVCache, LlamaModel, SequenceChunk, layout_batch
from ..model.attention_metadata import verification_rows
from . import prompt_logprobs
from .cuda_graphs import DecodeGraphs
from .logits_processing import batch_processing
from .outputs import TokenLogprob
from .piecewise_graphs import PiecewiseGraphs
from .request import Request
from .speculative.proposer import Proposal
from .speculative.verify import verify


@dataclass(slots=True)
class StepResult:
    """Sampled token per request that completed its uncomputed tokens this step (and per
    sample that forks from such a request), those rows' logits (for tracing) and, where asked
    for, their logprobs, in the same order. verified: per speculating request, the tokens it
    gains (accepted proposals, then the recovered or bonus token)."""

    requests: list[Request]
    token_ids: list[int]
    logits: torch.Tensor | None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    verified: list[tuple[Request, list[int]]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        cuda_graphs: bool = False,
        piecewise_tokens: int | None = None,
    ):
        """piecewise_tokens: the largest mixed step replayed from piecewise graphs (the
        engine's max_num_batched_tokens), None: mixed steps run eagerly."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.graphs = None
        self.piecewise = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, kv_cache, max_num_seqs, max_model_len)
            if self.device.type == "cuda":
                self.graphs.capture()
        if piecewise_tokens is not None:
            self.piecewise = PiecewiseGraphs(
                model, kv_cache, max_num_seqs, piecewise_tokens, max_model_len
            )
            if self.device.type == "cuda":
                self.piecewise.capture()

    def run(
        self,
        entries: list[tuple[Request, int]],
        forks: Mapping[Request, Sequence[Request]] | None = None,
        proposals: Mapping[Request, Proposal] | None = None,
    ) -> StepResult:
        """Run the batch; `forks`: for a request whose prompt completes now, the further
        samples (n > 1) that draw their first token from the same logits row; `proposals`:
        the speculating requests' proposals (their entry counts 1 + the proposal's length)."""
        proposals = proposals or {}
        # Prefill chunks first, then one-token rows: the layout the model's metadata expects;
        # verification rows last.
        ordered = [e for e in entries if e[1] > 1 and e[0] not in proposals]
        ordered += [e for e in entries if e[1] == 1 and e[0] not in proposals]
        chunks = [
            SequenceChunk(
                r.ids_between(r.num_computed_tokens, r.num_computed_tokens + n),
                r.num_computed_tokens,
                r.block_table,
            )
            for r, n in ordered
        ]
        rows = [i for i, (r, n) in enumerate(ordered) if r.num_computed_tokens + n == r.num_tokens]
        speculating = [r for r, _ in entries if r in proposals]
        for r in speculating:
            last = r.ids_between(r.num_computed_tokens, r.num_computed_tokens + 1)
            chunk = SequenceChunk(
                [*last, *proposals[r].token_ids], r.num_computed_tokens, r.block_table
            )
            rows += range(len(chunks), len(chunks) + 1 + len(proposals[r].token_ids))
            chunks += verification_rows(chunk)
        layout = layout_batch(chunks, self.kv_cache.block_size, logits_rows=rows)
        plain = self.graphs is not None and not speculating
        if plain and layout.num_prefills == 0 and len(rows) == len(chunks):
            logits = self.graphs.run(layout)  # every row a decode that samples: replay a graph
        elif (
            self.piecewise is not None
            and not speculating
            and self.piecewise.covers(layout)
            and not prompt_logprobs.wanted(ordered)
        ):
            logits = self.piecewise.run(layout)  # a mixed step: pieces replayed, attention eager
        else:
            tp = self.model.tp  # TP rank 0: broadcasts the step; a failure in it is fatal
            with tp.fatal_errors():
                input_ids, meta = tp.upload(layout, self.device, logits=bool(rows))
                if not rows or prompt_logprobs.wanted(ordered):
                    # mid-prompt chunks (fill the cache, skip the LM head) or prompt logprobs
                    hidden = self.model.hidden_states(input_ids, meta, self.kv_cache)
                    prompt_logprobs.record(self.model, hidden, ordered, layout.cu_seqlens)
                    if not rows:
                        return StepResult([], [], None)
                    lm_rows = hidden[meta.logits_indices]
                    logits = tp.gather_logits(self.model.compute_logits(lm_rows))
                else:
                    logits = self.model(input_ids, meta, self.kv_cache)
        verified = []
        if speculating:
            num_sampled = len(rows) - sum(1 + len(proposals[r].token_ids) for r in speculating)
            gains = verify(logits[num_sampled:], speculating, [proposals[r] for r in speculating])
            verified = list(zip(speculating, gains, strict=True))
            logits, rows = logits[:num_sampled], rows[:num_sampled]
            if not rows:
                return StepResult([], [], None, verified=verified)
        requests = [ordered[i][0] for i in rows]
        if forks:
            index = list(range(len(requests)))
            for row, request in enumerate(list(requests)):
                for sample in forks.get(request, ()):
                    requests.append(sample)
                    index.append(row)
            if len(index) > len(rows):
                logits = logits[torch.tensor(index, device=logits.device)]
        ids, logprobs = self.sample(logits, requests)
        return StepResult(requests, ids, logits, logprobs, verified)

    def sample(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One id per row, with each request's parameters; the step offset is the number of
        tokens it has generated, so its draws do not depend on its batch neighbours. The
        parameters go up in one copy; the ids come back in one. Logits processing and logprobs
        where a request asks for them (engine/logits_processing.py)."""
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
        masks = [r.grammar.bitmask() if r.grammar is not None else None for r in requests]
        processing = batch_processing(
            [r.logits_state for r in requests], [r.output_ids for r in requests], masks
        )
        kwargs = {
            name: a.to(logits.device, non_blocking=True) for name, a in processing.arrays.items()
        }
        rows, n = logits.shape[0], processing.num_top_logprobs
        if processing.want_logprobs:
            kwargs["logprobs"] = torch.empty(rows, dtype=torch.float32, device=logits.device)
            if n:
                kwargs["top_ids"] = torch.empty(rows, n, dtype=torch.int32, device=logits.device)
                kwargs["top_logprobs"] = torch.empty(rows, n, device=logits.device)
        ids = ops.sample(logits, temperature, top_p, top_k, seeds, offsets, **kwargs).tolist()
        if not processing.want_logprobs:
            return ids, [None] * rows
        sampled = kwargs["logprobs"].tolist()
        top_ids = kwargs["top_ids"].tolist() if n else [[]] * rows
        top_values = kwargs["top_logprobs"].tolist() if n else [[]] * rows
        logprobs: list[TokenLogprob | None] = []
        for r, p in enumerate(params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            k = p.logprobs
            top = tuple(zip(top_ids[r][:k], top_values[r][:k], strict=True))
            logprobs.append(TokenLogprob(ids[r], sampled[r], top))
        return ids, logprobs
