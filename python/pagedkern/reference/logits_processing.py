"""Logits processing before sampling: penalties, bias, masks, min-p, and the logprob outputs.

The inputs every sampling backend takes (the engine builds them in
engine/logits_processing.py, host work proportional to the sparse entries, never to V):

  token_offsets int32 [B + 1], token_ids int32 [nnz], token_counts int32 [nnz],
  token_bias float32 [nnz]: row r's sparse entries are token_offsets[r] .. token_offsets[r+1],
    distinct ids within a row. count >= 0: the token is in the row's penalty set (prompt +
    generated tokens) and was generated `count` times; count = -1: a bias-only entry.
    bias: logit_bias, and -inf for a banned token (a bad word's last id, EOS before
    min_tokens).
  presence_penalty, frequency_penalty, repetition_penalty float32 [B].
  bitmask int32 [M, ceil(V / 32)], bitmask_rows int32 [B]: row r may only sample token t if
    bitmask_rows[r] < 0 or bit t % 32 of bitmask[bitmask_rows[r], t // 32] is set (grammar
    masks, allowed_token_ids).
  min_p float32 [B] (0: off).

Semantics, in this order, in fp32 (what the CUDA kernel reproduces):
  1. x = logits (NaN = -inf). For each sparse entry (t, count, bias) of the row:
     if count >= 0: x[t] = x[t] / rep if x[t] > 0 else x[t] * rep        (HF / vLLM)
                    x[t] -= frequency * count + presence * (count > 0)  (OpenAI)
     x[t] += bias; a NaN result (inf - inf) is -inf.
  2. Tokens not allowed by the row's bitmask: x = -inf.
  3. Sampling (reference.sampling) on x: greedy at temperature <= 0, else s = x / T, then
     min-p keeps tokens with softmax(s) >= min_p * max softmax(s) (s >= s_max + log min_p),
     then top-k, top-p and the draw.
  4. Logprobs: log_softmax of s (of x for greedy rows, as at T = 1; a row holding +inf is
     uniform over its +inf entries), i.e. AFTER penalties, bias, masks and temperature and
     BEFORE min-p / top-k / top-p truncation (vLLM's "processed_logprobs"; vLLM's default
     is the raw model logits). A row with no finite value has -inf logprobs. Top-N: the N
     largest, ties to the lower id, in descending order.
"""

from __future__ import annotations

import torch


def process_logits(
    logits: torch.Tensor,
    *,
    token_offsets: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
    token_bias: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
    repetition_penalty: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 1 and 2 of the module docstring: fp32 [B, V], a new tensor."""
    rows, vocab = logits.shape
    inf = float("inf")
    x = torch.nan_to_num(logits.float(), nan=-inf, posinf=inf, neginf=-inf)  # a new tensor
    if token_offsets is not None and token_ids is not None and token_ids.numel():
        offsets = token_offsets.long()
        row_of = torch.repeat_interleave(
            torch.arange(rows, device=x.device), offsets[1:] - offsets[:-1]
        )
        ids = token_ids.long()
        counts = token_counts.long()
        value = x[row_of, ids]
        in_set = counts >= 0
        rep = repetition_penalty.float()[row_of]
        rep_value = torch.where(value > 0, value / rep, value * rep)
        c = counts.clamp(min=0).float()
        penalty = (
            frequency_penalty.float()[row_of] * c
            + presence_penalty.float()[row_of] * (c > 0).float()
        )
        value = torch.where(in_set, rep_value - penalty, value) + token_bias.float()
        value = torch.where(torch.isnan(value), torch.full_like(value, float("-inf")), value)
        x[row_of, ids] = value
    if bitmask is not None and bitmask_rows is not None:
        masked = bitmask_rows.long() >= 0
        if bool(masked.any()):
            words = bitmask[bitmask_rows.long()[masked]].long() & 0xFFFFFFFF  # [m, W]
            bits = (words[:, :, None] >> torch.arange(32, device=x.device)) & 1
            allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].bool()
            sub = x[masked]
            x[masked] = torch.where(allowed, sub, torch.full_like(sub, float("-inf")))
    return x


def logprobs_of(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Step 4: log-probabilities [B, V] of processed logits x under each row's temperature."""
    posinf = torch.isposinf(x)
    only_inf = torch.where(posinf, torch.zeros_like(x), torch.full_like(x, float("-inf")))
    x = torch.where(posinf.any(-1, keepdim=True), only_inf, x)
    t = temperature.float()
    s = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    s = torch.where(torch.isnan(s) | torch.isposinf(s), torch.full_like(s, float("-inf")), s)
    out = torch.log_softmax(s, dim=-1)
    return torch.where(torch.isnan(out), torch.full_like(out, float("-inf")), out)


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest log-probabilities per row, descending, ties to the lower id: (int32 ids,
    float32 values), each [B, n]."""
    # a stable descending sort keeps equal values in id order
    values, ids = logprobs.sort(dim=-1, descending=True, stable=True)
    return ids[:, :n].to(torch.int32), values[:, :n].float()


def min_p_filter(s: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Step 3's min-p on scaled logits s [B, V]: tokens below min_p * the top probability
    become -inf (min_p <= 0: off)."""
    on = min_p > 0
    if not bool(on.any()):
        return s
    s_max = s.max(dim=-1, keepdim=True).values
    cutoff = s_max + torch.log(torch.where(on, min_p.float(), torch.ones_like(min_p)))[:, None]
    drop = on[:, None] & (s < cutoff) & torch.isfinite(s_max)
    return s.masked_fill(drop, float("-inf"))


def write_top_logprobs(
    logits: torch.Tensor,
    temperature,
    top_ids: torch.Tensor,
    top_values: torch.Tensor,
    sampled: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    **processing,
) -> None:
    """Fill top_ids / top_values [B, N] with the N most likely tokens of the processed
    distribution (what `sample` writes; min_p, which comes after, is ignored), and, given the
    sampled ids [B], `logprobs` [B] with theirs from the same log-softmax: a sampled token in
    the top-N has its value there to the bit (a greedy row's is the top-1)."""
    processing.pop("min_p", None)
    rows = logits.shape[0]
    t = torch.as_tensor(temperature, device=logits.device).float()
    t = t.expand(rows) if t.dim() == 0 else t
    lp = logprobs_of(process_logits(logits, **processing), t)
    ids, values = top_logprobs(lp, top_ids.shape[1])
    top_ids.copy_(ids)
    top_values.copy_(values)
    if sampled is not None and logprobs is not None:
        logprobs.copy_(lp.gather(1, sampled.long()[:, None])[:, 0])
