"""Per-request logits-processing state, kept on the host and updated incrementally, and the
batch inputs of `ops.sample` built from it (semantics: pagedkern.reference.logits_processing).

Host work per step is proportional to each row's sparse entries (distinct penalised tokens,
biases, bans), never to the vocabulary: the (token id, count) list grows by at most one entry
per generated token; an allowed_token_ids mask is built once per request ([V / 32] words);
a grammar mask comes from the structured-output matcher.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from .sampling_params import SamplingParams

NEG_INF = float("-inf")


class NoTokenAllowed(ValueError):
    """A request's masks and bans (response_format, allowed_token_ids, bad_words, min_tokens)
    left no token to sample: it fails alone (HTTP: a 400)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def mask_allows(mask: torch.Tensor, token: int) -> bool:
    """Whether an int32 bitmask (allowed_bitmask's layout) has `token`'s bit set."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def allowed_bitmask(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """int32 [ceil(V / 32)] with bit t % 32 of word t // 32 set for each allowed token t."""
    words = torch.zeros(bitmask_words(vocab_size), dtype=torch.int64)
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.int64)
    words.index_add_(0, ids // 32, torch.ones_like(ids) << (ids % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class LogitsState:
    """One request's processing state: the penalty set (prompt tokens when repetition_penalty
    is on, plus every generated token) with generated counts, its static biases and bans, its
    bad-word sequences and its allowed-token mask."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        stop_ids: Sequence[int],
        vocab_size: int,
    ):
        self.params = params
        self.penalised = params.has_penalties
        self.index: dict[int, int] = {}
        self.ids = array("i")
        self.counts = array("i")
        if params.repetition_penalty != 1:
            for token in prompt_ids:
                self._add(token, 0)
        self.bias: dict[int, float] = dict(params.logit_bias or {})
        self.multi_word: list[tuple[int, ...]] = []
        for word in params.bad_words:
            if len(word) == 1:
                self.bias[word[0]] = NEG_INF
            else:
                self.multi_word.append(word)
        self.stop_ids = tuple(sorted(set(stop_ids)))  # masked until min_tokens are generated
        self.mask = (
            None
            if params.allowed_token_ids is None
            else allowed_bitmask(params.allowed_token_ids, vocab_size)
        )
        # prompt_logprobs: entry p for prompt token p, filled as the prompt is computed
        # (engine/prompt_logprobs.py); the first token has none
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(prompt_ids)
        # Whether this row has sparse entries at all (fixed at admission; read every step).
        p = params
        self.active = bool(
            self.penalised or self.bias or self.multi_word or p.min_tokens or p.min_p > 0
        )
        # Whether its mask or bans could leave no token (penalties, biases and min_p cannot)
        self.restricts = self.mask is not None or bool(p.bad_words) or bool(p.min_tokens)

    def _add(self, token: int, count: int) -> None:
        j = self.index.get(token)
        if j is None:
            self.index[token] = len(self.ids)
            self.ids.append(token)
            self.counts.append(count)
        else:
            self.counts[j] += count

    def append(self, token: int) -> None:
        """Account one generated token (O(1))."""
        if self.penalised:
            self._add(token, 1)

    def _step_bias(self, output_ids: Sequence[int]) -> dict[int, float]:
        """The static biases and bans plus this step's: a bad word's last token where its
        prefix ends the output, the stop tokens before min_tokens."""
        extra = dict(self.bias)
        for word in self.multi_word:
            head = len(word) - 1
            if len(output_ids) >= head and tuple(output_ids[len(output_ids) - head :]) == word[:-1]:
                extra[word[-1]] = NEG_INF
        if len(output_ids) < self.params.min_tokens:
            extra.update(dict.fromkeys(self.stop_ids, NEG_INF))
        return extra

    def allows(self, token: int, output_ids: Sequence[int]) -> bool:
        """Whether this step's mask and bans let `token` be sampled after `output_ids`. The
        samplers draw only allowed tokens, save when none is left (then token 0): a sampled
        token this refuses means that."""
        if self.mask is not None and not mask_allows(self.mask, token):
            return False
        return self._step_bias(output_ids).get(token) != NEG_INF

    def entries(self, output_ids: Sequence[int]) -> tuple[list[int], list[int], list[float]]:
        """This step's sparse (ids, counts, biases): the penalty set (count >= 0) merged with
        the biases and this step's bans (count -1 where the token is not in the set)."""
        ids, counts = list(self.ids), list(self.counts)
        bias = [0.0] * len(ids)
        extra = self._step_bias(output_ids)
        for token, value in extra.items():
            j = self.index.get(token)
            if j is None:
                ids.append(token)
                counts.append(-1)
                bias.append(value)
            else:
                bias[j] += value
        return ids, counts, bias


@dataclass(slots=True)
class BatchProcessing:
    """`ops.sample` keyword arguments for a batch (host tensors; the runner moves them)."""

    arrays: dict[str, torch.Tensor]
    num_top_logprobs: int  # N of the top_ids / top_logprobs outputs (0: none)
    want_logprobs: bool


def batch_processing(
    states: Sequence[LogitsState],
    outputs: Sequence[Sequence[int]],
    grammar_masks: Sequence[torch.Tensor | None],
) -> BatchProcessing:
    """The processing inputs of one batch (rows in `states` order). Rows without processing
    cost nothing; a batch without any gets no processing arrays at all (the plain kernel)."""
    arrays: dict[str, torch.Tensor] = {}
    params = list(map(_params_of, states))
    if any(map(_active, states)):
        offsets, ids, counts, bias = [0], [], [], []
        for state, out in zip(states, outputs, strict=True):
            if state.active:
                i, c, b = state.entries(out)
                ids += i
                counts += c
                bias += b
            offsets.append(len(ids))
        arrays["token_offsets"] = torch.tensor(offsets, dtype=torch.int32)
        arrays["token_ids"] = torch.tensor(ids, dtype=torch.int32)
        arrays["token_counts"] = torch.tensor(counts, dtype=torch.int32)
        arrays["token_bias"] = torch.tensor(bias, dtype=torch.float32)
        arrays["presence_penalty"] = torch.tensor(
            [p.presence_penalty for p in params], dtype=torch.float32
        )
        arrays["frequency_penalty"] = torch.tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32
        )
        arrays["repetition_penalty"] = torch.tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32
        )
        if any(p.min_p > 0 for p in params):
            arrays["min_p"] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    masks = list(map(_mask_of, states))  # C-level passes: a plain batch costs ~nothing here
    if len(masks) != len(grammar_masks):
        raise ValueError(f"{len(states)} rows but {len(grammar_masks)} grammar masks")
    if masks.count(None) + grammar_masks.count(None) < 2 * len(masks):
        masks = [_combine(m, g) for m, g in zip(masks, grammar_masks, strict=True)]
        present = [m for m in masks if m is not None]
        arrays["bitmask"] = torch.stack(present)
        rows_of, k = [], 0
        for m in masks:
            rows_of.append(-1 if m is None else k)
            k += m is not None
        arrays["bitmask_rows"] = torch.tensor(rows_of, dtype=torch.int32)
    logprobs = list(map(_logprobs_of, params))
    want = logprobs.count(None) < len(logprobs)
    top = max((n for n in logprobs if n), default=0) if want else 0
    return BatchProcessing(arrays, top, want)


_active = attrgetter("active")
_params_of = attrgetter("params")
_mask_of = attrgetter("mask")
_logprobs_of = attrgetter("logprobs")


def _combine(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a & b
