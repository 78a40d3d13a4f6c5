"""Speculative verification: accept or reject each request's proposed tokens against the target
distribution, then draw the recovered (on rejection) or bonus (all accepted) token.

Layout (B requests, request b proposed k_b >= 0 tokens, D = sum k_b, T = D + B):
  cu_draft        int32 [B + 1]  prefix sums of k_b (cu_draft[0] = 0).
  draft_token_ids int32 [D]      request b's proposals at rows cu_draft[b] .. cu_draft[b+1]-1.
  draft_probs     float [D, V]   the distribution each proposal was drawn from; None means a
                                 point mass at the proposal (n-gram lookup).
  target_probs    float [T, V]   the distribution `sample` would draw from at each of request b's
                                 k_b + 1 positions (reference.sampling.sampling_distribution:
                                 processed, tempered, truncated, renormalised; one-hot under
                                 greedy), rows cu_draft[b] + b .. cu_draft[b+1] + b.
  seeds, offsets  int64 [B]      the request's seed and the offset of its first new token (the
                                 number of tokens it has generated): position j draws with
                                 offset offsets[b] + j, so draws depend only on seed and position.
Rule (Leviathan et al. 2023; Chen et al. 2023), position j = 0 .. k_b - 1, proposal x:
  u = philox4x32_10(counter=(offset + j, 0), key=seed) word 1 / 2^32; accept iff u * q(x) < p(x)
  (probability min(1, p(x)/q(x)); q(x) = 1 for a point mass). At the first rejection draw the
  recovered token from norm(max(0, p - q)) and stop; if every proposal is accepted draw the bonus
  token from the target at position k_b. Both draws use word 0 of the same counter by inverse CDF
  over ids in vocabulary order (the first id whose cumulative mass exceeds u0 * total strictly),
  which is exactly `sample`'s draw: a request with k_b = 0 gets the token `sample` gives it. If
  the residual has no mass (p <= q everywhere, possible only by rounding), draw from p.
Greedy (one-hot p) accepts exactly the proposals equal to the argmax and then yields the argmax.
Outputs: out_token_ids int32 [B, max k + 1] (accepted proposals, then the recovered or bonus
token, then -1 padding) and out_num_tokens int32 [B] (accepted + 1, always >= 1).
"""

from __future__ import annotations

import torch

from .sampling import uniforms


def _draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.double().cumsum(0)
    total = float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True))
    return min(index, probs.numel() - 1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_draft: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_token_ids [B, max k + 1], out_num_tokens [B]); semantics in the module docstring."""
    cu = [int(c) for c in cu_draft.tolist()]
    batch = len(cu) - 1
    max_k = max((cu[b + 1] - cu[b] for b in range(batch)), default=0)
    out = torch.full((batch, max_k + 1), -1, dtype=torch.int32)
    num = torch.zeros(batch, dtype=torch.int32)
    target = target_probs.double().cpu()
    drafts = draft_token_ids.long().cpu()
    q_all = None if draft_probs is None else draft_probs.double().cpu()
    # Every position's uniforms in one vectorised Philox call (row cu[b] + b + j: offset + j).
    lengths = torch.tensor([cu[b + 1] - cu[b] + 1 for b in range(batch)], dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    owner = torch.repeat_interleave(torch.arange(batch), lengths)
    position = torch.arange(int(lengths.sum())) - starts[owner]
    u_draw_all, u_accept_all = uniforms(
        seeds.long().cpu()[owner], offsets.long().cpu()[owner] + position
    )
    for b in range(batch):
        k = cu[b + 1] - cu[b]
        row = cu[b] + b
        u_draw, u_accept = u_draw_all[row : row + k + 1], u_accept_all[row : row + k + 1]
        token = None
        for j in range(k):
            x = int(drafts[cu[b] + j])
            p = target[row + j]
            q = None if q_all is None else q_all[cu[b] + j]
            qx = 1.0 if q is None else float(q[x])
            if float(u_accept[j]) * qx < float(p[x]):
                out[b, j] = x
                continue
            residual = p.clone()
            if q is None:
                residual[x] = 0.0
            else:
                residual = (p - q).clamp(min=0.0)
            if not float(residual.sum()) > 0.0:
                residual = p
            token, num[b] = _draw(residual, float(u_draw[j])), j + 1
            break
        if token is None:  # every proposal accepted: the bonus token from position k
            token, num[b] = _draw(target[row + k], float(u_draw[k])), k + 1
        out[b, int(num[b]) - 1] = token
    return out, num
