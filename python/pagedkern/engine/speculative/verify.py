"""Verification of one step's proposals: the target distribution at every verified position,
then the acceptance rule (reference/rejection_sampling.py states the layout and the rule).

Position j of a request (j = 0 .. k; j = 0 is the token after its last one) is processed as if
proposals 0 .. j-1 had been generated: its penalties count them, its bad-word and min_tokens
masks see them, so the target is exactly the distribution non-speculative `sample` would draw
that position from (reference.sampling_distribution). Draws are seeded by the request's seed
and the position's offset (tokens generated before it), never by the batch or by k.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import ModuleType

import torch

from ... import ops, reference
from ...reference import logits_processing
from ..logits_processing import LogitsState, batch_processing
from ..request import Request
from .proposer import Proposal

# Where rejection_sample comes from: pagedkern.ops (csrc/rejection_sampling.cu on a GPU, the
# reference elsewhere); tests pass `sampler=` to compare against the reference directly.
REJECTION_SAMPLER: ModuleType = ops


def _state_after(state: LogitsState, generated: Sequence[int]) -> LogitsState:
    """A copy of `state` that has also generated `generated` (O(its sparse entries))."""
    if not generated or not state.penalised:
        return state
    clone = copy.copy(state)
    clone.index, clone.ids, clone.counts = dict(state.index), state.ids[:], state.counts[:]
    for token in generated:
        clone.append(token)
    return clone


def target_probs(
    logits: torch.Tensor, requests: Sequence[Request], proposals: Sequence[Proposal]
) -> torch.Tensor:
    """float64 [sum(k_b + 1), V]: request b's k_b + 1 rows of `logits` (in order) as the
    distributions non-speculative sampling would draw those positions from."""
    params, arrays = _row_processing(logits, requests, proposals)
    min_p = arrays.pop("min_p", None)
    dev = logits.device
    return reference.sampling_distribution(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
        min_p,
        **arrays,
    )


def _row_processing(
    logits: torch.Tensor, requests: Sequence[Request], proposals: Sequence[Proposal]
) -> tuple[list, dict[str, torch.Tensor]]:
    """Per verified row, its request's SamplingParams, and the logits-processing arrays of all
    rows on the logits' device, each row processed as of its position."""
    states, outputs, params = [], [], []
    for request, proposal in zip(requests, proposals, strict=True):
        state, out = request.logits_state, request.output_ids
        for j in range(len(proposal.token_ids) + 1):
            before = proposal.token_ids[:j]
            states.append(_state_after(state, before))
            # the whole output is copied only for rows whose processing reads it
            outputs.append([*out, *before] if j and state.active else out)
            params.append(request.params)
    processing = batch_processing(states, outputs, [None] * len(states))
    return params, {name: a.to(logits.device) for name, a in processing.arrays.items()}


def _greedy(
    logits: torch.Tensor, requests: Sequence[Request], proposals: Sequence[Proposal]
) -> list[list[int]]:
    """Greedy requests: the rejection rule with a one-hot target accepts exactly the proposals
    equal to the processed argmax and then yields the argmax, whatever the draft's q (see
    reference/rejection_sampling.py), so the argmax of each row is all it needs."""
    _, arrays = _row_processing(logits, requests, proposals)
    arrays.pop("min_p", None)  # a greedy row's argmax is the processed logits' argmax
    best = logits_processing.process_logits(logits, **arrays).argmax(-1).tolist()
    gains, row = [], 0
    for proposal in proposals:
        k = len(proposal.token_ids)
        target = best[row : row + k + 1]
        a = 0
        while a < k and proposal.token_ids[a] == target[a]:
            a += 1
        gains.append([*proposal.token_ids[:a], target[a]])
        row += k + 1
    return gains


def verify(
    logits: torch.Tensor,
    requests: Sequence[Request],
    proposals: Sequence[Proposal],
    sampler: ModuleType | None = None,
) -> list[list[int]]:
    """The tokens each request gains this step: its accepted proposals, then the recovered or
    bonus token (1 .. k_b + 1 ids). logits: [sum(k_b + 1), V], request b's rows in order.
    Greedy requests take the argmax shortcut, the others the rejection sampler."""
    greedy = [r.params.temperature <= 0 for r in requests]
    if any(greedy):
        starts = [0]
        for p in proposals:
            starts.append(starts[-1] + len(p.token_ids) + 1)
        pick = [i for i, g in enumerate(greedy) if g]
        rest = [i for i, g in enumerate(greedy) if not g]
        gains: list[list[int]] = [[] for _ in requests]

        def rows(indices: list[int]) -> torch.Tensor:
            ids = [j for i in indices for j in range(starts[i], starts[i + 1])]
            return logits[torch.tensor(ids, device=logits.device)]

        for i, g in zip(
            pick,
            _greedy(rows(pick), [requests[i] for i in pick], [proposals[i] for i in pick]),
            strict=True,
        ):
            gains[i] = g
        if rest:
            sub = [requests[i] for i in rest], [proposals[i] for i in rest]
            for i, g in zip(rest, _sampled(rows(rest), *sub, sampler), strict=True):
                gains[i] = g
        return gains
    return _sampled(logits, requests, proposals, sampler)


def _sampled(
    logits: torch.Tensor,
    requests: Sequence[Request],
    proposals: Sequence[Proposal],
    sampler: ModuleType | None = None,
) -> list[list[int]]:
    """The rejection rule (REJECTION_SAMPLER) on the target distributions."""
    sampler = REJECTION_SAMPLER if sampler is None else sampler
    dev = logits.device
    counts = [len(p.token_ids) for p in proposals]
    cu = [0]
    for k in counts:
        cu.append(cu[-1] + k)
    draft_ids = [t for p in proposals for t in p.token_ids]
    draft_probs = None
    if any(p.draft_probs is not None for p in proposals):  # a draft model: dense q rows
        vocab = logits.shape[1]
        rows = []
        for p in proposals:
            if p.draft_probs is not None:
                rows.append(p.draft_probs.to(dev, torch.float32))
            elif p.token_ids:  # a point mass written out
                ids = torch.tensor(p.token_ids, device=dev)
                rows.append(torch.nn.functional.one_hot(ids, vocab).float())
        draft_probs = torch.cat(rows) if rows else None
    out, num = sampler.rejection_sample(
        target_probs(logits, requests, proposals).float(),  # float32: what the kernel takes
        torch.tensor(draft_ids, dtype=torch.int32, device=dev),
        draft_probs,
        torch.tensor(cu, dtype=torch.int32, device=dev),
        torch.tensor([r.seed for r in requests], dtype=torch.int64, device=dev),
        torch.tensor([len(r.output_ids) for r in requests], dtype=torch.int64, device=dev),
    )
    return [row[:n] for row, n in zip(out.tolist(), num.tolist(), strict=True)]
