"""Verification of one step's proposals: the target distribution at every verified position,
then the acceptance rule (reference/rejection_sampling.py states the layout and the rule).

Position j of a request (j = 0 .. k; j = 0 is the token after its last one) is processed as if
proposals 0 .. j-1 had been generated: its penalties count them, its bad-word and min_tokens
masks see them, so the target is exactly the distribution non-speculative `sample` would draw
that position from (reference.sampling_distribution). Draws are seeded by the request's seed
and the position's offset (tokens generated before it), never by the batch or by k.

Three rules, per request:
- greedy: the argmax shortcut (what the rejection rule gives a one-hot target);
- a request given a seed: the coupled rule. Each position draws the token non-speculative
  `sample` would draw there (its seed, its offset, word 0); proposal j is accepted iff it equals
  position j's draw, and the first draw that differs (or the bonus draw) ends the step. The
  output is always the plain draws, so the tokens are those of a run without speculation,
  whatever is proposed, however many positions the batch lets it verify. A point-mass proposal
  x is accepted with probability p(x), as by the rejection rule; a draft model's proposal, drawn
  with the same uniform by inverse CDF (draft.py), with the probability that the two inverse
  CDFs agree;
- otherwise the rejection rule (reference/rejection_sampling.py), which accepts with
  min(1, p/q): the most a draft model can get accepted.
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
    logits: torch.Tensor,
    requests: Sequence[Request],
    proposals: Sequence[Proposal],
    sampler: ModuleType | None = None,
) -> list[list[int]]:
    """Greedy requests: the rejection rule with a one-hot target accepts exactly the proposals
    equal to the processed argmax and then yields the argmax, whatever the draft's q (see
    reference/rejection_sampling.py), so the argmax of each row is all it needs."""
    _, arrays = _row_processing(logits, requests, proposals)
    arrays.pop("min_p", None)  # a greedy row's argmax is the processed logits' argmax
    best = logits_processing.process_logits(logits, **arrays).argmax(-1).tolist()
    return _accepted(proposals, best)


def verify(
    logits: torch.Tensor,
    requests: Sequence[Request],
    proposals: Sequence[Proposal],
    sampler: ModuleType | None = None,
) -> list[list[int]]:
    """The tokens each request gains this step: its accepted proposals, then the recovered or
    bonus token (1 .. k_b + 1 ids). logits: [sum(k_b + 1), V], request b's rows in order.
    Each request goes by its rule (the module docstring): greedy, coupled or rejection."""
    rules = [_rule(r) for r in requests]
    verifiers = {"greedy": _greedy, "coupled": _coupled, "rejection": _rejection}
    if len(set(rules)) == 1:  # (the usual step: no row gather)
        return verifiers[rules[0]](logits, requests, proposals, sampler)
    starts = [0]
    for p in proposals:
        starts.append(starts[-1] + len(p.token_ids) + 1)
    gains: list[list[int]] = [[] for _ in requests]
    for rule, verifier in verifiers.items():
        picked = [i for i, r in enumerate(rules) if r == rule]
        if not picked:
            continue
        ids = [j for i in picked for j in range(starts[i], starts[i + 1])]
        rows = logits[torch.tensor(ids, device=logits.device)]
        sub = [requests[i] for i in picked], [proposals[i] for i in picked]
        for i, g in zip(picked, verifier(rows, *sub, sampler), strict=True):
            gains[i] = g
    return gains


def _rule(request: Request) -> str:
    if request.params.temperature <= 0:
        return "greedy"
    return "coupled" if request.params.seed is not None else "rejection"


def _accepted(proposals: Sequence[Proposal], draws: list[int]) -> list[list[int]]:
    """Per request, its proposals up to the first that differs from its position's token in
    `draws` (request b's k_b + 1 positions in order), then that position's token."""
    gains, row = [], 0
    for proposal in proposals:
        k = len(proposal.token_ids)
        target = draws[row : row + k + 1]
        a = 0
        while a < k and proposal.token_ids[a] == target[a]:
            a += 1
        gains.append([*proposal.token_ids[:a], target[a]])
        row += k + 1
    return gains


def _coupled(
    logits: torch.Tensor,
    requests: Sequence[Request],
    proposals: Sequence[Proposal],
    sampler: ModuleType | None = None,
) -> list[list[int]]:
    """Seeded requests: every position's plain draw, then the proposals that equal them. The
    draws come from REJECTION_SAMPLER with no proposals (one position each), which draws the
    bonus token exactly as `sample` draws."""
    sampler = REJECTION_SAMPLER if sampler is None else sampler
    dev = logits.device
    seeds, offsets = [], []
    for request, proposal in zip(requests, proposals, strict=True):
        for j in range(len(proposal.token_ids) + 1):
            seeds.append(request.seed)
            offsets.append(len(request.output_ids) + j)
    draws, _ = sampler.rejection_sample(
        target_probs(logits, requests, proposals).float(),  # float32: what the kernel takes
        torch.zeros(0, dtype=torch.int32, device=dev),
        None,
        torch.zeros(len(seeds) + 1, dtype=torch.int32, device=dev),
        torch.tensor(seeds, dtype=torch.int64, device=dev),
        torch.tensor(offsets, dtype=torch.int64, device=dev),
    )
    return _accepted(proposals, draws[:, 0].tolist())


def _rejection(
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
