"""Runs one scheduled iteration on the model: the flattened batch and its metadata from the
requests' state, one forward pass, and sampling of the rows whose prompt is fully computed.
A steady decode step (every entry one token that samples) is laid out from the persistent
batch (engine/input_batch.py: only what changed since the last step is read per request);
any other step from per-request chunks (model.layout_batch). Speculating requests feed their
last token and proposals as one-token decode rows (model/attention_metadata.verification_rows),
get logits for every row, and are verified (engine/speculative/verify.py) instead of sampled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .. import ops
from ..model import BatchLayout, KVCache, LlamaModel, SequenceChunk, layout_batch
from ..model.attention_metadata import verification_rows
from ..ops import cpu as cpu_ops
from ..ops import launch
from ..ops.cpu.direct import direct_cpu_calls
from . import prompt_logprobs
from .cuda_graphs import DecodeGraphs
from .input_batch import DecodeStep, InputBatch
from .logits_processing import BatchProcessing, batch_processing
from .non_finite import checked_gains, checked_ids
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


@dataclass(slots=True)
class SamplingInputs:
    """A batch's sampling parameters on the host, (seeds, offsets, temperature, top_p, top_k)
    as int64, int64, float32, float32, int32 numpy arrays, and its logits processing
    (ModelRunner.sampling_inputs)."""

    fields: tuple[np.ndarray, ...]
    processing: BatchProcessing

    def on(self, device: torch.device) -> list[torch.Tensor]:
        """The five as tensors on `device`: on the CPU views of the host arrays, elsewhere
        from one packed buffer (int64s first: every part's view is aligned) and one copy."""
        if device.type == "cpu":
            return [torch.from_numpy(f) for f in self.fields]
        packed = torch.from_numpy(np.concatenate([f.view(np.uint8) for f in self.fields]))
        if device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=True)
        parts = packed.split([f.nbytes for f in self.fields])
        return [p.view(t) for p, t in zip(parts, TORCH_SAMPLING_DTYPES, strict=True)]


TORCH_SAMPLING_DTYPES = (torch.int64, torch.int64, torch.float32, torch.float32, torch.int32)


@dataclass(slots=True)
class PreparedStep:
    """A step laid out on the host (ModelRunner.prepare), ready to run (execute). rows: the
    chunks whose last row gets logits (sampled rows first, then verification rows); the first
    num_sampled sample. sampling: the sampling inputs when built ahead (asynchronous
    scheduling; None: built from the requests at sampling time). fill_rows / fill_from:
    placeholder input rows and the rows of the previous step's ids that fill them."""

    ordered: Sequence[tuple[Request, int]]
    layout: BatchLayout
    rows: Sequence[int]
    num_sampled: int
    speculating: list[Request]
    proposals: Mapping[Request, Proposal]
    forks: Mapping[Request, Sequence[Request]] | None
    sampling: SamplingInputs | None = None
    want_prompt_logprobs: bool | None = None
    fill_rows: list[int] = field(default_factory=list)
    fill_from: list[int] = field(default_factory=list)
    sampled: list[Request] | None = None  # a decode step's requests, row order (no forks)
    # The result's logits are read after the next step ran (asynchronous scheduling with a
    # tracer): a copy, as a graph replay returns its static output, which the next overwrites.
    own_logits: bool = False

    def sample_requests(self) -> tuple[list[Request], Sequence[int]]:
        """The requests that sample, in row order (n > 1: the samples that fork from a leader
        after them), and the logits row each draws from."""
        if self.sampled is not None:
            return self.sampled, range(len(self.sampled))
        requests = [self.ordered[i][0] for i in self.rows[: self.num_sampled]]
        index = list(range(len(requests)))
        if self.forks:
            for row, request in enumerate(list(requests)):
                for sample in self.forks.get(request, ()):
                    requests.append(sample)
                    index.append(row)
        return requests, index


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
        self.batch = InputBatch(kv_cache.block_size, max_num_seqs)
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
        return self.execute(self.prepare(entries, forks, proposals))

    def prepare(
        self,
        entries: list[tuple[Request, int]],
        forks: Mapping[Request, Sequence[Request]] | None = None,
        proposals: Mapping[Request, Proposal] | None = None,
        pending: Mapping[Request, int] | None = None,
    ) -> PreparedStep:
        """The host half of `run`: the batch layout (block tables, positions, slots read now,
        so the scheduler may change them once this returns). `pending` (asynchronous
        scheduling): request -> its row in the previous step's sampled ids, for the requests
        whose input token that step is still sampling; their rows are placeholders that
        `execute` fills, and the sampling inputs are built here too."""
        if not proposals and not forks and self.kv_cache.groups is None:
            decode = self.batch.decode_step(entries, pending)  # (one table per row)
            if decode is not None:
                return self._decode_step(entries, decode, pending is not None)
        return self.prepare_chunks(entries, forks, proposals, pending)

    def _decode_step(self, entries, decode: DecodeStep, overlapped: bool) -> PreparedStep:
        """A steady decode step from the persistent batch: every row samples, none forks."""
        requests, b = decode.requests, len(decode.requests)
        step = PreparedStep(entries, decode.layout, range(b), b, [], {}, None)
        step.sampled = requests
        step.want_prompt_logprobs = False
        step.fill_rows, step.fill_from = decode.fill_rows, decode.fill_from
        if decode.sampling is not None:
            fields = decode.sampling
            if overlapped:  # the persistent batch's columns change before this step runs
                fields = tuple(f.copy() for f in fields)
            step.sampling = SamplingInputs(fields, BatchProcessing({}, 0, False))
        elif overlapped:  # read now: the engine thread moves the requests on meanwhile
            step.sampling = self.sampling_inputs(requests)
        return step

    def prepare_chunks(
        self,
        entries: list[tuple[Request, int]],
        forks: Mapping[Request, Sequence[Request]] | None = None,
        proposals: Mapping[Request, Proposal] | None = None,
        pending: Mapping[Request, int] | None = None,
    ) -> PreparedStep:
        """`prepare` for any step (the general path): one SequenceChunk per request."""
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
                r.group_tables,
            )
            for r, n in ordered
        ]
        fill = []  # (chunk index, row in the previous step's ids) per placeholder
        if pending:
            for i, (r, n) in enumerate(ordered):
                j = pending.get(r)
                if j is not None:
                    assert n == 1 and not chunks[i].token_ids, "a placeholder is one decode row"
                    chunks[i].token_ids = [0]
                    fill.append((i, j))
        rows = [i for i, (r, n) in enumerate(ordered) if r.num_computed_tokens + n == r.num_tokens]
        num_sampled = len(rows)
        speculating = [r for r, _ in entries if r in proposals]
        for r in speculating:
            last = r.ids_between(r.num_computed_tokens, r.num_computed_tokens + 1)
            chunk = SequenceChunk(
                [*last, *proposals[r].token_ids],
                r.num_computed_tokens,
                r.block_table,
                r.group_tables,
            )
            rows += range(len(chunks), len(chunks) + 1 + len(proposals[r].token_ids))
            chunks += verification_rows(chunk)
        layout = layout_batch(chunks, self.kv_cache.block_size, logits_rows=rows)
        step = PreparedStep(ordered, layout, rows, num_sampled, speculating, proposals, forks)
        if fill:
            step.fill_rows = [int(layout.cu_seqlens[i]) for i, _ in fill]
            step.fill_from = [j for _, j in fill]
        if pending is not None:  # read now: the engine thread moves the requests on meanwhile
            step.sampling = self.sampling_inputs(step.sample_requests()[0])
            step.want_prompt_logprobs = prompt_logprobs.wanted(ordered)
        return step

    def execute(self, step: PreparedStep, previous: StepResult | None = None) -> StepResult:
        """The device half of `run`: fill the placeholders from `previous` (the step before,
        already run: the worker runs steps in order), upload, forward, verify, sample."""
        layout, rows = step.layout, step.rows
        speculating, proposals = step.speculating, step.proposals
        if step.fill_rows:
            if previous is None:
                raise RuntimeError("placeholder rows without the step that samples them")
            # (a NON_FINITE draw's request fails at its append: any id will do until then)
            layout.input_ids[step.fill_rows] = [
                max(previous.token_ids[j], 0) for j in step.fill_from
            ]
        ordered = step.ordered
        wanted = step.want_prompt_logprobs  # read at prepare time under overlap
        if wanted is None:
            wanted = prompt_logprobs.wanted(ordered)
        plain = self.graphs is not None and not speculating
        if plain and layout.num_prefills == 0 and len(rows) == len(layout.seq_lens):
            logits = self.graphs.run(layout)  # every row a decode that samples: replay a graph
        elif (
            self.piecewise is not None
            and not speculating
            and self.piecewise.covers(layout)
            and not wanted
        ):
            logits = self.piecewise.run(layout)  # a mixed step: pieces replayed, attention eager
        else:
            tp = self.model.tp  # TP rank 0: broadcasts the step; a failure in it is fatal
            extra = prompt_logprobs.rows(ordered, layout.cu_seqlens) if wanted else []
            if extra:  # one LM head (under TP one gather) over the prompt rows and the sampled
                layout = replace(layout, logits_indices=[*extra, *layout.logits_indices])
            with tp.fatal_errors():
                input_ids, meta = tp.upload(layout, self.device, logits=bool(rows or extra))
                if not rows and not extra:  # mid-prompt chunks: fill the cache, no LM head
                    self.model.hidden_states(input_ids, meta, self.kv_cache)
                    return StepResult([], [], None)
                logits = self.model(input_ids, meta, self.kv_cache)
                if extra:
                    prompt_logprobs.record(logits[: len(extra)], ordered)
                    if not rows:
                        return StepResult([], [], None)
                    logits = logits[len(extra) :]
        verified = []
        if speculating:
            num_sampled = step.num_sampled
            rows, mine = logits[num_sampled:], [proposals[r] for r in speculating]
            gains = checked_gains(verify(rows, speculating, mine), mine, rows)
            verified = list(zip(speculating, gains, strict=True))
            logits = logits[:num_sampled]
            if not num_sampled:
                return StepResult([], [], None, verified=verified)
        requests, index = step.sample_requests()
        if len(index) > step.num_sampled:  # n > 1: the samples draw from their leader's row
            logits = logits[torch.tensor(index, device=logits.device)]
        if step.sampling is None:
            ids, logprobs = self.sample(logits, requests)
        else:
            ids, logprobs = self.draw(logits, requests, step.sampling)
        if step.own_logits:
            logits = logits.clone()
        return StepResult(requests, ids, logits, logprobs, verified)

    def sample(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One id per row, with each request's parameters; the step offset is the number of
        tokens it has generated (in flight included), so its draws do not depend on its batch
        neighbours. Logits processing and logprobs where a request asks for them
        (engine/logits_processing.py)."""
        return self.draw(logits, requests, self.sampling_inputs(requests))

    def sampling_inputs(self, requests: list[Request]) -> SamplingInputs:
        """The host side of sampling `requests`: their parameters packed into one buffer (one
        copy up) and their logits processing."""
        params = [r.params for r in requests]
        fields = (
            np.array([r.seed for r in requests], dtype=np.int64),
            np.array([len(r.output_ids) + r.num_pending for r in requests], dtype=np.int64),
            np.array([p.temperature for p in params], dtype=np.float32),
            np.array([p.top_p for p in params], dtype=np.float32),
            np.array([p.top_k for p in params], dtype=np.int32),
        )
        masks = [r.grammar.bitmask() if r.grammar is not None else None for r in requests]
        processing = batch_processing(
            [r.logits_state for r in requests], [r.output_ids for r in requests], masks
        )
        return SamplingInputs(fields, processing)

    def draw(
        self, logits: torch.Tensor, requests: list[Request], inputs: SamplingInputs
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample `logits` with `inputs` (sampling_inputs); the ids come back in one copy."""
        processing = inputs.processing
        seeds, offsets, temperature, top_p, top_k = inputs.on(logits.device)
        kwargs = {
            name: a.to(logits.device, non_blocking=True) for name, a in processing.arrays.items()
        }
        rows, n = logits.shape[0], processing.num_top_logprobs
        if processing.want_logprobs:
            kwargs["logprobs"] = torch.empty(rows, dtype=torch.float32, device=logits.device)
            if n:
                kwargs["top_ids"] = torch.empty(rows, n, dtype=torch.int32, device=logits.device)
                kwargs["top_logprobs"] = torch.empty(rows, n, device=logits.device)
        ids = checked_ids(
            _sampler(logits.device)(logits, temperature, top_p, top_k, seeds, offsets, **kwargs),
            logits,
        )
        if not processing.want_logprobs:
            return ids, [None] * rows
        sampled = kwargs["logprobs"].tolist()
        top_ids = kwargs["top_ids"].tolist() if n else [[]] * rows
        top_values = kwargs["top_logprobs"].tolist() if n else [[]] * rows
        logprobs: list[TokenLogprob | None] = []
        for r, p in enumerate(request.params for request in requests):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            k = p.logprobs
            top = tuple(zip(top_ids[r][:k], top_values[r][:k], strict=True))
            logprobs.append(TokenLogprob(ids[r], sampled[r], top))
        return ids, logprobs


def _sampler(device: torch.device):
    """ops.sample, or on the CPU backend its implementation there: the runner's arrays are its
    own, and their checks cost more than the C++ draw of a row."""
    if not direct_cpu_calls(device):
        return ops.sample
    launch.record_launch("sample")
    return _cpu_sample


def _cpu_sample(logits, temperature, top_p, top_k, seeds, offsets, *, top_logprobs=None, **kw):
    """The CPU backend's sample under ops.sample's keywords."""
    sample = cpu_ops.implementation_of("sample")
    return sample(
        logits, temperature, top_p, top_k, seeds, offsets, top_logprobs_out=top_logprobs, **kw
    )
