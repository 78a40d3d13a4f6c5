"""A request as the engine sees it: a sequence state that every stage reads and writes
(the reference document's R42: ids, block table, computed tokens, status, timestamps), and
everything the engine keeps per request: its stop ids, detokenizer, deadline, logits state,
grammar and, for the first sample of an n > 1 request, the samples waiting for its prompt."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .logits_processing import LogitsState
    from .structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, waiting for KV blocks and a place in a batch
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    PREEMPTED = "preempted"  # blocks taken back; will recompute its KV from its ids
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS / end-of-turn, a stop token id or a stop string
    LENGTH = "length"  # max_tokens
    CONTEXT = "context_length"  # the model's context is full
    ABORT = "abort"  # cancelled by the caller
    TIMEOUT = "timeout"
    ERROR = "error"


# A request cut off by a limit, not ended by its text: a stop string its last ids' text
# completes (found only at the end, IncrementalDetokenizer.flush) makes it STOP.
ENDED_BY_A_LIMIT = frozenset({FinishReason.LENGTH, FinishReason.CONTEXT, FinishReason.TIMEOUT})


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]  # immutable: output snapshots share it
    params: SamplingParams
    messages: list[dict] | None = None
    prompt_text: str | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # hybrid KV groups 1.. (per-kind tables, model/kv_cache.py): as long as block_table
    group_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache at admission
    # Asynchronous scheduling (engine/overlap.py): tokens sampled by a step still in flight,
    # not yet in output_ids (at most 2: step N's and N+1's); num_tokens counts them.
    num_pending: int = 0
    # Its next step needs host state from the tokens before it (penalties, bad words,
    # min_tokens, grammar, prompt logprobs): a step holding it runs synchronously.
    needs_sync: bool = False
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    seed: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    logits_state: LogitsState | None = None  # penalties, biases, masks (set at admission)
    grammar: GrammarMatcher | None = None  # structured output
    sample_index: int = 0  # n > 1: which sample of the parent request
    parent_id: str | None = None
    # n > 1, the first sample: the other samples, waiting for its prompt's KV to fork from
    forks: list[Request] | None = None
    stop_ids: frozenset[int] = frozenset()  # token ids that end it (EOS unless ignore_eos)
    # None: outputs carry ids only (the HTTP front end detokenizes and matches stop strings)
    detokenizer: IncrementalDetokenizer | None = None
    deadline: float | None = None  # params.timeout after arrival, on the engine clock's scale
    # Set by the engine at admission, so the append loop checks one number and one flag per
    # token: the output length that ends it (max_tokens, or the context if that comes first),
    # and whether its plain decode tokens may leave as TokenDeltas columns (no logprobs, no
    # grammar, not a sample of an n > 1 request).
    output_limit: int = 0
    columnar: bool = False

    def __post_init__(self) -> None:
        self.prompt_ids = tuple(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output, with the tokens a step in flight is sampling (the scheduler's
        view: they take KV slots and budget like any other)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def all_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    def ids_between(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without concatenating the whole sequence
        (a decode step needs one id of a possibly long sequence)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return list(self.prompt_ids[start:end])
        return [*self.prompt_ids[start:], *self.output_ids[: end - p]]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def may_speculate(self) -> bool:
        """Speculative decoding skips requests with structured output (the grammar matcher
        would have to be advanced through proposals and rolled back) and with logprobs (each
        accepted token's logprobs are not computed): they decode one token per step."""
        return self.grammar is None and self.params.logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def metrics(self) -> dict[str, float | None]:
        """TTFT, TPOT (mean time per output token after the first), ITLs, tokens/s (for the
        tracer; outputs carry a typed snapshot, outputs.RequestMetrics)."""
        end = self.finish_time or (self.token_times[-1] if self.token_times else None)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        itl = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        tpot = sum(itl) / len(itl) if itl else None
        elapsed = None if end is None else end - self.arrival_time
        rate = len(self.output_ids) / elapsed if elapsed else None
        return {
            "ttft": ttft,
            "tpot": tpot,
            "itl": itl,
            "tokens_per_s": rate,
            "num_output_tokens": len(self.output_ids),
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
        }
