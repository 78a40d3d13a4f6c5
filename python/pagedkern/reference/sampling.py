"""Token sampling: temperature, top-k, top-p, greedy; per-row parameters; counter-based RNG.

Semantics (what every sampling kernel must reproduce in distribution):
  1. logits in fp32; NaN counts as -inf. A row holding +inf samples uniformly among its +inf
     entries (top-k and top-p do not narrow that set further).
  2. temperature <= 0: greedy, argmax with ties to the lowest id.
  3. Otherwise s = logits / temperature. top-k (k <= 0 or k >= vocab: off) keeps every token with
     s >= the k-th largest s, ties included. p = softmax over the kept tokens.
  4. top-p (p >= 1: off) keeps token i iff the mass of tokens strictly more probable than i is
     < top_p; the most probable tokens are always kept. Ties are kept or dropped together.
  5. The id is drawn from p restricted to the kept set, renormalised, by inverse CDF over ids in
     vocabulary order with u = philox4x32_10(counter=(offset, 0), key=seed)[0] / 2^32. Same
     (seed, offset, logits, parameters), same id, whatever else is in the batch.
  Logits processing (penalties, bias, masks, min-p, logprobs) comes first and is described in
  reference/logits_processing.py; min-p narrows the candidates after temperature, before top-k.
  6. A row with no finite logit, or whose scaled logits overflow (a tiny temperature), falls back
     to greedy (id 0 if all are -inf): always a valid id. The draw is the first id whose
     cumulative mass exceeds u * total strictly, so a zero-probability id is never drawn.
"""

from __future__ import annotations

import torch

from .logits_processing import logprobs_of, min_p_filter, process_logits, top_logprobs

_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a constant a and int64 tensor b < 2^32, overflow-free."""
    low = b * (a & 0xFFFF)  # < 2^48
    high = b * (a >> 16)  # < 2^48
    t = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (t >> 32), t & _MASK32


def philox4x32(
    counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor], rounds: int = 10
) -> tuple[torch.Tensor, ...]:
    """Philox4x32 (Salmon et al., 2011) on int64 tensors holding 32-bit words; 4 words out."""
    c0, c1, c2, c3 = (c & _MASK32 for c in counter)
    k0, k1 = (k & _MASK32 for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo32(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Words 0 and 1 of philox4x32_10(counter=(offset, 0), key=seed) as float64 in [0, 1), per
    (seed, offset) pair: word 0 is `sample`'s draw, word 1 speculative acceptance's."""
    zero = torch.zeros_like(offsets)
    words = philox4x32((offsets, offsets >> 32, zero, zero), (seeds, seeds >> 32))
    return words[0].double() / 2.0**32, words[1].double() / 2.0**32


def uniform(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per (seed, offset) pair: the draw `sample` uses."""
    return uniforms(seeds, offsets)[0]


def per_row(value, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).to(dtype)
    return t.expand(rows) if t.dim() == 0 else t.reshape(rows)


def kept_probs(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Steps 1 and 3-4 on processed logits x [B, V] with [B] parameters: the unnormalised
    probabilities sample draws from (float32, zero outside the kept set; an all-zero row means
    the greedy fallback). Rows with temperature <= 0 are scaled by 1; the caller takes argmax."""
    vocab = x.shape[1]
    sampled = temperature > 0
    posinf = torch.isposinf(x)
    only_inf = torch.where(posinf, torch.zeros_like(x), torch.full_like(x, float("-inf")))
    x = torch.where(posinf.any(-1, keepdim=True), only_inf, x)
    s = x / torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]
    s = min_p_filter(s, torch.where(sampled, min_p, torch.zeros_like(min_p)))

    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    if bool((k < vocab).any()):
        kth = s.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        s = s.masked_fill(s < kth, float("-inf"))
    # Rows with no finite s (all -inf, or s overflowed to +inf) give NaN: zero them so
    # top-p stays in bounds and the row falls back to greedy (total == 0).
    probs = torch.softmax(s, dim=-1).nan_to_num(nan=0.0)

    if bool((top_p < 1).any()):
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        before = ranked.cumsum(-1) - ranked
        tie_start = torch.searchsorted(-ranked, -ranked, side="left")
        above = before.gather(1, tie_start)  # mass strictly more probable than each token
        keep = (above < top_p[:, None]) | (above == 0) | (top_p[:, None] >= 1)
        probs = probs * torch.zeros_like(keep).scatter(1, order, keep)
    return probs


def sampling_distribution(
    logits: torch.Tensor, temperature, top_p, top_k, min_p=None, **processing
) -> torch.Tensor:
    """The distribution `sample` draws row i from, as float64 [B, V] summing to 1: the
    processed, tempered, truncated, renormalised probabilities; a one-hot at the greedy id for
    temperature <= 0 rows and for rows that fall back to greedy. Speculative decoding verifies
    against exactly this (reference/rejection_sampling.py)."""
    rows, vocab = logits.shape
    dev = logits.device
    temperature = per_row(temperature, rows, torch.float32, dev)
    top_p = per_row(top_p, rows, torch.float32, dev)
    top_k = per_row(top_k, rows, torch.int64, dev)
    min_p = per_row(0.0 if min_p is None else min_p, rows, torch.float32, dev)
    x = process_logits(logits, **processing)
    greedy = torch.nn.functional.one_hot(x.argmax(dim=-1), vocab).double()
    probs = kept_probs(x, temperature, top_p, top_k, min_p).double()
    total = probs.sum(-1, keepdim=True)
    valid = (temperature > 0)[:, None] & torch.isfinite(total) & (total > 0)
    return torch.where(valid, probs / torch.where(valid, total, 1.0), greedy)


def sample(
    logits: torch.Tensor,
    temperature,
    top_p,
    top_k,
    seeds,
    offsets=0,
    out: torch.Tensor | None = None,
    *,
    min_p=None,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs_out: torch.Tensor | None = None,
    **processing,
) -> torch.Tensor:
    """One token id per row of logits [B, V] (int32 [B]); parameters are [B] tensors or scalars:
    temperature float, top_p float, top_k int, seeds int64, offsets int64 (e.g. the number of
    tokens the request has generated so far), min_p float. `processing`: the sparse penalty /
    bias entries and bitmask of reference.logits_processing.process_logits. Outputs written
    when given: logprobs float32 [B] (the sampled token's), top_ids int32 [B, N] and
    top_logprobs_out float32 [B, N]. Semantics in the module docstrings."""
    rows, vocab = logits.shape
    dev = logits.device
    temperature = per_row(temperature, rows, torch.float32, dev)
    top_p = per_row(top_p, rows, torch.float32, dev)
    top_k = per_row(top_k, rows, torch.int64, dev)
    seeds = per_row(seeds, rows, torch.int64, dev)
    offsets = per_row(offsets, rows, torch.int64, dev)
    min_p = per_row(0.0 if min_p is None else min_p, rows, torch.float32, dev)

    x = process_logits(logits, **processing)
    processed = x
    ids = x.argmax(dim=-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        probs = kept_probs(x, temperature, top_p, top_k, min_p)
        cdf = probs.double().cumsum(-1)
        total = cdf[:, -1:]
        drawn = torch.searchsorted(cdf, uniform(seeds, offsets)[:, None] * total, right=True)
        drawn = drawn[:, 0].clamp(max=vocab - 1)
        valid = sampled & torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
        ids = torch.where(valid, drawn, ids)
    ids = ids.to(torch.int32)
    if logprobs is not None or top_ids is not None:
        lp = logprobs_of(processed, temperature)
        if logprobs is not None:
            logprobs.copy_(lp.gather(1, ids.long()[:, None])[:, 0])
        if top_ids is not None and top_ids.shape[1]:
            best_ids, best = top_logprobs(lp, top_ids.shape[1])
            top_ids.copy_(best_ids)
            top_logprobs_out.copy_(best)
    if out is None:
        return ids
    out.copy_(ids)
    return out
