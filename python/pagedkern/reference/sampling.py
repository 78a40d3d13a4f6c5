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
  6. A row with no finite logit, or whose scaled logits overflow (a tiny temperature), falls back
     to greedy (id 0 if all are -inf): always a valid id. The draw is the first id whose
     cumulative mass exceeds u * total strictly, so a zero-probability id is never drawn.
"""

from __future__ import annotations

import torch

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


def uniform(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per (seed, offset) pair: the draw `sample` uses."""
    zero = torch.zeros_like(offsets)
    words = philox4x32((offsets, offsets >> 32, zero, zero), (seeds, seeds >> 32))
    return words[0].double() / 2.0**32


def _per_row(value, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).to(dtype)
    return t.expand(rows) if t.dim() == 0 else t.reshape(rows)


def sample(
    logits: torch.Tensor,
    temperature,
    top_p,
    top_k,
    seeds,
    offsets=0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of logits [B, V] (int32 [B]); parameters are [B] tensors or scalars:
    temperature float, top_p float, top_k int, seeds int64, offsets int64 (e.g. the number of
    tokens the request has generated so far). Semantics in the module docstring."""
    rows, vocab = logits.shape
    dev = logits.device
    temperature = _per_row(temperature, rows, torch.float32, dev)
    top_p = _per_row(top_p, rows, torch.float32, dev)
    top_k = _per_row(top_k, rows, torch.int64, dev)
    seeds = _per_row(seeds, rows, torch.int64, dev)
    offsets = _per_row(offsets, rows, torch.int64, dev)

    x = logits.float()
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    ids = x.argmax(dim=-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        posinf = torch.isposinf(x)
        only_inf = torch.where(posinf, torch.zeros_like(x), torch.full_like(x, float("-inf")))
        x = torch.where(posinf.any(-1, keepdim=True), only_inf, x)
        s = x / torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]

        k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
        if bool((k < vocab).any()):
            kth = s.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            s = s.masked_fill(s < kth, float("-inf"))
        # Rows with no finite s (all -inf, or s overflowed to +inf) give NaN: zero them so
        # top-p stays in bounds and the row falls back to greedy (total == 0) below.
        probs = torch.softmax(s, dim=-1).nan_to_num(nan=0.0)

        if bool((top_p < 1).any()):
            ranked, order = probs.sort(dim=-1, descending=True, stable=True)
            before = ranked.cumsum(-1) - ranked
            tie_start = torch.searchsorted(-ranked, -ranked, side="left")
            above = before.gather(1, tie_start)  # mass strictly more probable than each token
            keep = (above < top_p[:, None]) | (above == 0) | (top_p[:, None] >= 1)
            probs = probs * torch.zeros_like(keep).scatter(1, order, keep)

        cdf = probs.double().cumsum(-1)
        total = cdf[:, -1:]
        drawn = torch.searchsorted(cdf, uniform(seeds, offsets)[:, None] * total, right=True)
        drawn = drawn[:, 0].clamp(max=vocab - 1)
        valid = sampled & torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
        ids = torch.where(valid, drawn, ids)
    ids = ids.to(torch.int32)
    if out is None:
        return ids
    out.copy_(ids)
    return out
