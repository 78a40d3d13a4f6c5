"""Prompt logprobs (`SamplingParams.prompt_logprobs`, OpenAI completions' echo + logprobs): the
log-probability of each prompt token given the tokens before it, and the N most likely tokens
there, from the raw model logits (temperature 1, no processing, as vLLM's prompt_logprobs).

The runner computes the hidden states of every row of a step anyway; for a step holding a prompt
chunk of a request that asked, it keeps them and `record` puts the LM head over that chunk's rows
(row at position p predicts prompt token p + 1) and fills the request's
`logits_state.prompt_logprobs` by position, so a recomputed chunk (preemption) rewrites the same
entries. Such a request never takes prefix-cache hits (scheduler), so every position is computed.
Cost: one LM head row and one log-softmax over V per prompt token of such requests only.
Under tensor parallelism the extra LM head would need its own collective: not recorded there
(the entries stay None).
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


def record(
    model, hidden: torch.Tensor, entries: Sequence[tuple[Request, int]], cu_seqlens: Sequence[int]
) -> None:
    """Fill the prompt logprobs of the entries' prompt chunks from the step's hidden states
    [T, H] (rows of entry b: cu_seqlens[b] .. cu_seqlens[b + 1])."""
    if model.tp.size > 1:
        return
    for b, (request, n) in enumerate(entries):
        table = _table(request)
        start = request.num_computed_tokens
        last = min(start + n, len(request.prompt_ids) - 1)  # rows predicting a prompt token
        if table is None or last <= start:
            continue
        rows = hidden[cu_seqlens[b] : cu_seqlens[b] + last - start]
        lp = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
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
