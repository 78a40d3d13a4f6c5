"""The draft-model proposer: a smaller model of the same vocabulary runs k cheap steps ahead of
the target, and its guesses go to verification.

The draft is either the target's own first N layers plus its final norm and LM head
(`self:N`, LayerSkip-style self-speculation: the same weight tensors, no copies) or a second
model loaded the way the engine loads its own (a GGUF file, a HF folder, `synthetic:<preset>`).

KV: the draft has its own paged cache with the target's number of blocks and block size,
indexed by each request's own block table: the engine has reserved slots for num_tokens + k
before it asks, so the draft needs no allocator of its own. Per request the proposer remembers
which ids its cache holds K/V for: the ids it fed, of which only the common prefix with the
request's current prompt + output is still right (rejected proposals never reach the output).

propose(), batched over the requests: one catch-up forward (every request's ids past its valid
prefix, through the prefill path; usually the one or two tokens the last step accepted), then
k - 1 one-token decode steps feeding back the previous proposal. Greedy requests propose the
draft's argmax. Sampled ones draw from the draft's own distribution under the request's
temperature, top-p, top-k and min-p (reference.sampling_distribution, no penalties) at counter
= the output index of the proposed token, by inverse CDF. A request given a seed draws with
the target's own uniform (its seed): verification keeps the target's plain draws and accepts a
proposal that equals one, which the shared uniform makes likely where the two distributions
agree. The others draw from a Philox stream keyed by the seed XOR DRAFT_SEED_KEY, independent
of the rejection rule's draws as that rule needs; those rows come back as draft_probs, what the
rule divides by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ... import ops
from ...model import KVCache, LlamaModel, LlamaWeights, SequenceChunk, build_batch
from ...model.loading import SYNTHETIC_PREFIX
from ...reference import sampling_distribution
from ...reference.sampling import uniform
from ..request import Request
from .proposer import Proposal

if TYPE_CHECKING:
    from ..config import EngineConfig

SELF_PREFIX = "self:"
# XORed into a request's seed: the draft's draws come from their own Philox key, so they are
# independent of the target's (which use the request's seed itself).
DRAFT_SEED_KEY = 0x5DEECE66D1CE4E5B  # < 2^63: a seed XOR it stays a signed int64


def self_draft(target: LlamaModel, num_layers: int) -> LlamaModel:
    """The target's first `num_layers` layers with its final norm and LM head, sharing every
    weight tensor (and the RoPE table) with the target."""
    w = target.weights
    weights = LlamaWeights(w.embed, w.layers[:num_layers], w.norm, w.lm_head, w.rope_freq_factors)
    # the per-layer fields cut to those layers too (a ModelConfig checks layer_types names
    # every layer and dense_layers only existing ones)
    target_config = target.config
    config = target_config.replace(
        name=f"{target_config.name} (first {num_layers} layers)",
        num_layers=num_layers,
        layer_types=target_config.layer_types[:num_layers],
        dense_layers=tuple(i for i in target_config.dense_layers if i < num_layers),
    )
    draft = LlamaModel(config, weights, target.max_positions, target.kv_cache_dtype)
    draft.cos_sin = target.cos_sin  # the same tables: do not keep two
    draft.cos_sin_local = target.cos_sin_local
    return draft


def _self_layers(draft_model: str, target: LlamaModel) -> int:
    layers = target.config.num_layers
    text = draft_model.removeprefix(SELF_PREFIX)
    if not text.isdigit() or not 1 <= int(text) <= layers:
        raise ValueError(
            f"draft_model {draft_model!r}: self:N needs N in 1..{layers} (the target's layers)"
        )
    if target.tp.size > 1:
        raise ValueError(
            f"draft_model {draft_model!r}: a self-draft of a tensor-parallel target is not "
            "supported (load a separate draft model instead)"
        )
    return int(text)


@dataclass(slots=True)
class _Held:
    """What the draft cache holds for one request: K/V of ids[:num_valid] (checked against
    the request when it was fed) followed by K/V of `tail` (proposals fed after them, right
    only as far as the request's output agrees with them)."""

    request: Request
    num_valid: int
    tail: list[int]
    num_preemptions: int  # a preemption frees the blocks: the cache there is stale

    def valid_prefix(self, request: Request) -> int:
        """How many of the request's current ids the draft cache holds correctly."""
        if request is not self.request or request.num_preemptions != self.num_preemptions:
            return 0
        n = self.num_valid
        current = request.ids_between(n, n + len(self.tail))
        agree = 0
        for fed, now in zip(self.tail, current):
            if fed != now:
                break
            agree += 1
        return n + agree


class DraftProposer:
    """Proposer (engine/speculative/proposer.py) backed by a draft model and its own paged KV
    cache over the target's block tables."""

    def __init__(
        self,
        draft: LlamaModel,
        kv_cache: KVCache,
        head: LlamaModel | None = None,
        backend: str = "auto",
    ):
        self.draft = draft
        self.kv_cache = kv_cache
        self.head = head or draft  # whose compute_logits to use (a self-draft: the target's)
        self.backend = backend
        self._held: dict[str, _Held] = {}

    @classmethod
    def create(
        cls,
        draft_model: str,
        target: LlamaModel,
        target_kv_cache: KVCache,
        config: EngineConfig,
    ) -> DraftProposer:
        """The proposer for `draft_model` (see `load`), its cache as many blocks as the
        target's."""
        return cls.over_cache(*cls.load(draft_model, target, config), target_kv_cache, config)

    @staticmethod
    def load(
        draft_model: str, target: LlamaModel, config: EngineConfig
    ) -> tuple[LlamaModel, LlamaModel | None]:
        """(the draft model, whose head it uses: None for its own) for `draft_model`: "self:N",
        or a model path / "synthetic:<preset>" loaded like the engine's own model (a synthetic
        draft from seed config.seed + 1, so a draft of the target's preset is a different random
        model). Raises ValueError naming draft_model when it cannot serve this target
        (vocabulary size, N out of range). The engine loads it before sizing the KV cache,
        whose budget then holds both caches."""
        if not isinstance(draft_model, str) or not draft_model:
            raise ValueError(f"draft_model must be a non-empty string, got {draft_model!r}")
        head = None
        if draft_model.startswith(SELF_PREFIX):
            draft = self_draft(target, _self_layers(draft_model, target))
            head = target  # same norm and LM head: share its fp32 head copy too
        else:
            seed = config.seed
            if draft_model.startswith(SYNTHETIC_PREFIX):
                seed = (seed + 1) % 2**63
            spec = dataclasses.replace(
                config.model_spec(),
                model=draft_model,
                seed=seed,
                max_positions=target.max_positions,
                longer_context=True,
            )
            draft, _ = spec.load(target.device)
            if draft.config.vocab_size != target.config.vocab_size:
                raise ValueError(
                    f"draft_model {draft_model!r}: its vocabulary has "
                    f"{draft.config.vocab_size} tokens, the target's tokenizer "
                    f"{target.config.vocab_size}; a draft must share the target's tokenizer"
                )
        return draft, head

    @classmethod
    def over_cache(
        cls,
        draft: LlamaModel,
        head: LlamaModel | None,
        target_kv_cache: KVCache,
        config: EngineConfig,
    ) -> DraftProposer:
        """The proposer of a loaded draft, with its own cache of the target cache's blocks."""
        with ops.use_backend(config.backend):
            kv = draft.allocate_kv_cache(target_kv_cache.num_blocks, target_kv_cache.block_size)
        return cls(draft, kv, head, config.backend)

    def forget(self, request: Request) -> None:
        self._held.pop(request.request_id, None)

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Proposal]:
        if len(requests) != len(max_tokens):
            raise ValueError(
                f"propose: {len(requests)} requests but {len(max_tokens)} max_tokens entries"
            )
        active = [i for i, k in enumerate(max_tokens) if k > 0]
        proposals = [Proposal(()) for _ in requests]
        if not active:
            return proposals  # nothing asked: no model run
        with ops.use_backend(self.backend), torch.inference_mode():
            tokens, probs = self._run(
                [requests[i] for i in active], [max_tokens[i] for i in active]
            )
        for i, ids, rows in zip(active, tokens, probs, strict=True):
            proposals[i] = Proposal(tuple(ids), None if rows is None else torch.stack(rows))
        return proposals

    def _run(
        self, requests: list[Request], ks: list[int]
    ) -> tuple[list[list[int]], list[list[torch.Tensor] | None]]:
        """Catch up, then decode: each request's proposed ids and, for sampled requests, the
        float32 [V] row each was drawn from."""
        starts = []
        for r in requests:
            held = self._held.get(r.request_id)
            valid = 0 if held is None else held.valid_prefix(r)
            starts.append(min(valid, r.num_tokens - 1))  # feed at least the last id
        chunks = [
            SequenceChunk(r.ids_between(s, r.num_tokens), s, r.block_table)
            for r, s in zip(requests, starts, strict=True)
        ]
        rows = list(range(len(requests)))
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor] | None] = [
            None if r.params.temperature <= 0 else [] for r in requests
        ]
        for step in range(max(ks)):
            if step:  # one decode row per request still proposing: its previous proposal
                rows = [i for i in rows if ks[i] > step]
                chunks = [
                    SequenceChunk(
                        [tokens[i][-1]], requests[i].num_tokens + step - 1, requests[i].block_table
                    )
                    for i in rows
                ]
            logits = self._forward(chunks)
            self._choose(
                logits,
                [requests[i] for i in rows],
                step,
                [tokens[i] for i in rows],
                [probs[i] for i in rows],
            )
        for r, k, ids in zip(requests, ks, tokens, strict=True):
            self._held[r.request_id] = _Held(r, r.num_tokens, ids[: k - 1], r.num_preemptions)
        return tokens, probs

    def _forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] float32 at each chunk's last token; writes the draft cache.
        Prefill chunks go first (layout_batch runs the trailing one-token chunks as decodes)."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) == 1)
        input_ids, meta = build_batch(
            [chunks[i] for i in order], self.kv_cache.block_size, self.draft.device
        )
        hidden = self.draft.hidden_states(input_ids, meta, self.kv_cache)
        logits = self.head.compute_logits(hidden[meta.logits_indices])
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(logits.device)]

    def _choose(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        step: int,
        tokens: list[list[int]],
        probs: list[list[torch.Tensor] | None],
    ) -> None:
        """Append each request's proposal at this step (and its draft_probs row)."""
        ids = logits.argmax(dim=-1)  # greedy rows: the draft's argmax (ties: the lowest id)
        sampled = [i for i, p in enumerate(probs) if p is not None]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            params = [requests[i].params for i in sampled]
            dist = sampling_distribution(
                logits[index],
                torch.tensor([p.temperature for p in params], device=logits.device),
                torch.tensor([p.top_p for p in params], device=logits.device),
                torch.tensor([p.top_k for p in params], device=logits.device),
                torch.tensor([p.min_p for p in params], device=logits.device),
            )
            seeds = torch.tensor([_draft_seed(requests[i]) for i in sampled])
            offsets = torch.tensor([len(requests[i].output_ids) + step for i in sampled])
            u = uniform(seeds, offsets).to(logits.device)
            # Inverse CDF over exactly the row handed back, so q(token) > 0 always: the first
            # id whose cumulative mass exceeds u * total strictly (sample's rule).
            cdf = dist.cumsum(-1)
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            ids[index] = drawn.clamp(max=logits.shape[1] - 1)
            rows = dist.float()
            for j, i in enumerate(sampled):
                probs[i].append(rows[j])
        for token, out in zip(ids.tolist(), tokens, strict=True):
            out.append(token)


def _draft_seed(request: Request) -> int:
    """The Philox key of a sampled request's draft draws (the module docstring says why)."""
    return request.seed if request.params.seed is not None else request.seed ^ DRAFT_SEED_KEY
