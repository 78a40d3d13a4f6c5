"""Prompt logprobs (`SamplingParams.prompt_logprobs`, OpenAI completions' echo + logprobs): the
log-probability of each prompt token given the tokens before it, and the N most likely tokens
there, from the raw model logits (temperature 1, no processing, as vLLM's prompt_logprobs).

The runner computes the hidden states of every row of a step anyway; for a step holding a prompt
chunk of a request that asked, `rows` names that chunk's rows (row at position p predicts prompt
token p + 1), the runner puts the LM head over them together with the rows it samples (one head,
so under tensor parallelism one gather of every rank's vocabulary shard: the workers run the
same head over the same rows), and `record` fills the request's `logits_state.prompt_logprobs`
by position from their logits, so a recomputed chunk (preemption) rewrites the same entries.
Such a request never takes prefix-cache hits (scheduler), so every position is computed.
Cost: one LM head row and one log-softmax over V per prompt token of such requests only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reference.logits_processing import top_logprobs
from .outputs import TokenLogprob
from .request import Request


def _table(request: Request) -> list | None:
    state = request.logits_state
    return None if state is None else state.prompt_logprobs


def wanted(entries: Sequence[tuple[Request, int]]) -> bool:
    """Whether a step's (request, new tokens) entries hold a prompt chunk that needs them."""
    return any(
        _table(r) is not None and r.num_computed_tokens + 1 < len(r.prompt_ids) for r, _ in entries
    )


def _span(request: Request, n: int) -> tuple[int, int]:
    """(first, end) prompt positions of a chunk of n tokens whose rows predict a prompt token."""
    start = request.num_computed_tokens
    return start, min(start + n, len(request.prompt_ids) - 1)


def rows(entries: Sequence[tuple[Request, int]], cu_seqlens: Sequence[int]) -> list[int]:
    """The step's rows (entry b: cu_seqlens[b] .. cu_seqlens[b + 1]) whose logits give prompt
    logprobs, entry by entry."""
    found: list[int] = []
    for b, (request, n) in enumerate(entries):
        start, last = _span(request, n)
        if _table(request) is not None and last > start:
            first = int(cu_seqlens[b])
            found += range(first, first + last - start)
    return found


def record(logits: torch.Tensor, entries: Sequence[tuple[Request, int]]) -> None:
    """Fill the entries' prompt logprobs from the full-vocabulary logits [len(rows), V] of the
    rows `rows(entries, ...)` named, in that order."""
    lp_all = torch.log_softmax(logits.float(), dim=-1)
    at = 0
    for request, n in entries:
        table = _table(request)
        start, last = _span(request, n)
        if table is None or last <= start:
            continue
        lp = lp_all[at : at + last - start]
        at += last - start
        targets = list(request.prompt_ids[start + 1 : last + 1])
        index = torch.tensor(targets, device=lp.device)[:, None]
        chosen = lp.gather(1, index)[:, 0].tolist()
        k = request.params.prompt_logprobs
        top_ids, top_values = top_logprobs(lp, k) if k else (None, None)
        top_ids = top_ids.tolist() if k else [[]] * len(targets)
        top_values = top_values.tolist() if k else [[]] * len(targets)
        for j, token in enumerate(targets):
            top = tuple(zip(top_ids[j], top_values[j], strict=True))
            table[start + 1 + j] = TokenLogprob(token, chosen[j], top)
