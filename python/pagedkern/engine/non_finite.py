"""Logits that come out NaN or infinite: the model's hidden state overflowed (an activation past
its dtype's range, say), so none of its row is a distribution, and the id a sampler draws from
it (often 0: an EOS on many models) must not reach the output.

The samplers and verification only read the logits, so a row is judged by the logit of the
token drawn from it: a non-finite hidden state makes its whole row non-finite, a finite one
never gives a drawn token a non-finite logit. The runner marks such a row NON_FINITE in the ids
it already copies to the host (a verified run: its every token checked on its row), and
OutputProcessor fails its request alone (NonFiniteLogits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .speculative.proposer import Proposal

NON_FINITE = -1


class NonFiniteLogits(RuntimeError):
    """The model's logits for a request were NaN or infinite (the model's numbers, not the
    request's fault: it fails alone, without a traceback)."""


def checked_ids(ids: torch.Tensor, logits: torch.Tensor) -> list[int]:
    """Drawn ids [B] of logits [B, V] as a list, NON_FINITE where the drawn token's logit is not
    finite: on the host a look at the values (~2 us), on a device one gather and where before
    the one copy."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        return [
            t if math.isfinite(values[r, t]) else NON_FINITE for r, t in enumerate(ids.tolist())
        ]
    drawn = logits.gather(1, ids.long()[:, None])[:, 0]
    return torch.where(torch.isfinite(drawn), ids, NON_FINITE).tolist()


def checked_gains(
    gains: list[list[int]], proposals: Sequence[Proposal], logits: torch.Tensor
) -> list[list[int]]:
    """verify()'s gains over its rows `logits` (request b's k_b + 1 in order; its i-th gained
    token drawn from its row i), [NON_FINITE] for a request one of whose gained tokens has a
    logit that is not finite there."""
    rows, cols, start = [], [], 0
    for proposal, gained in zip(proposals, gains, strict=True):
        rows += range(start, start + len(gained))
        cols += gained
        start += len(proposal.token_ids) + 1
    dev = logits.device
    drawn = logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]
    finite, out, at = torch.isfinite(drawn).tolist(), [], 0
    for gained in gains:
        ok = all(finite[at : at + len(gained)])
        out.append(gained if ok else [NON_FINITE])
        at += len(gained)
    return out
