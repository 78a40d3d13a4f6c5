"""What the engine hands out: immutable snapshots, never its live state.

A RequestOutput is one step's delta for one request plus a snapshot of the request at that
moment (prompt ids, output ids so far, metrics). Snapshots are O(1) to take: a request's output
ids and token times only ever grow, so a snapshot keeps a reference to those lists and its
length at the time, and reads only that prefix (as a tuple) when asked.

The engine makes one RequestOutput and one RequestMetrics per request per step, so their
construction is on the hot path: `of` builds them with plain attribute stores (`_builder`), not
through the frozen dataclass __init__, whose object.__setattr__ per field made a snapshot cost
~7x more. The objects are frozen all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass

from .request import FinishReason, Request


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Times are on the engine clock's scale (time.monotonic unless a test substitutes it)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at admission
    num_preemptions: int
    _token_times: list[float] = field(repr=False, compare=False)

    @classmethod
    def of(cls, request: Request) -> RequestMetrics:
        return _new_metrics(
            request.arrival_time,
            request.first_token_time,
            request.finish_time,
            len(request.prompt_ids),
            len(request.output_ids),
            request.num_cached_tokens,
            request.num_preemptions,
            request.token_times,
        )

    @property
    def token_times(self) -> tuple[float, ...]:
        return tuple(self._token_times[: self.num_output_tokens])

    @property
    def last_token_time(self) -> float | None:
        n = self.num_output_tokens
        return self._token_times[n - 1] if n else None

    @property
    def ttft(self) -> float | None:
        """Arrival to first token."""
        first = self.first_token_time
        return None if first is None else first - self.arrival_time

    @property
    def itl(self) -> tuple[float, ...]:
        """Inter-token latencies (one fewer than the output tokens)."""
        times = self.token_times
        return tuple(b - a for a, b in zip(times, times[1:]))

    @property
    def last_itl(self) -> float | None:
        """Time between the last two tokens (None before the second)."""
        n = self.num_output_tokens
        return self._token_times[n - 1] - self._token_times[n - 2] if n >= 2 else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (= the mean of `itl`)."""
        n = self.num_output_tokens
        if n < 2:
            return None
        return (self._token_times[n - 1] - self._token_times[0]) / (n - 1)

    @property
    def tokens_per_s(self) -> float | None:
        end = self.finish_time if self.finish_time is not None else self.last_token_time
        elapsed = None if end is None else end - self.arrival_time
        return self.num_output_tokens / elapsed if elapsed else None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated (or prompt) token's log-probability and the top-N alternatives, most likely
    first, from the processed distribution (reference.logits_processing, step 4)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: `text` and `token_ids` are new since the last
    output; `prompt_token_ids`, `output_token_ids` (all so far) and `metrics` describe the
    request as it was then. `error` says why a request finished with FinishReason.ERROR."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    prompt_token_ids: tuple[int, ...]
    metrics: RequestMetrics
    error: str | None = None
    _output_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    logprobs: tuple[TokenLogprob, ...] | None = None  # for token_ids, when asked for
    index: int = 0  # which of the request's n samples (request_id is the first's id + ".i")
    parent_id: str | None = None  # the request_id given at admission (n > 1)
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), on the output
    # that carries the first token and on the finishing one
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @classmethod
    def of(
        cls,
        request: Request,
        text: str,
        token_ids: tuple[int, ...],
        finished: bool,
        finish_reason: FinishReason | None = None,
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> RequestOutput:
        if logprobs is None and request.params.logprobs is not None:
            logprobs = ()
        return _new_output(
            request.request_id,
            text,
            token_ids,
            finished,
            finish_reason,
            request.prompt_ids,
            RequestMetrics.of(request),
            request.error,
            request.output_ids,
            logprobs,
            request.sample_index,
            request.parent_id,
            # with the first token (the prompt is computed then) and again with the last
            _prompt_logprobs(request) if finished or len(request.output_ids) == 1 else None,
        )

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_ids[: self.metrics.num_output_tokens])


def _builder(cls: type) -> Callable:
    """cls(*every field) for a frozen slots dataclass at the cost of a plain one: a mutable twin
    with the same slots is filled by ordinary attribute stores, then becomes a `cls` (same
    layout, so CPython allows the __class__ assignment; checked once, here, at import). The
    result is as frozen as one from cls(...)."""
    twin = make_dataclass(
        f"_{cls.__name__}Draft", [(f.name, f.type) for f in fields(cls)], slots=True
    )
    object.__new__(twin).__class__ = cls  # TypeError at import if the layouts ever differ

    def build(*values):
        obj = twin(*values)
        obj.__class__ = cls
        return obj

    return build


_new_metrics = _builder(RequestMetrics)
_new_output = _builder(RequestOutput)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state at one moment (`Engine.stats()`; call it where the engine runs)."""

    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, found
    num_prompt_tokens: int  # of every admitted request, since the engine started
    num_generated_tokens: int
    num_finished: int
    num_iterations: int
    max_num_seqs: int
    max_model_len: int
    # speculative decoding, since the engine started (all 0 without it)
    speculative: str = "none"
    num_spec_steps: int = 0  # request-steps that verified at least one proposal
    num_spec_proposed: int = 0  # proposed tokens
    num_spec_accepted: int = 0  # of those, accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.num_spec_accepted / self.num_spec_proposed if self.num_spec_proposed else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Accepted proposals per speculative step; a step yields this + 1 tokens."""
        return self.num_spec_accepted / self.num_spec_steps if self.num_spec_steps else 0.0


def _prompt_logprobs(request: Request) -> tuple[TokenLogprob | None, ...] | None:
    state = request.logits_state
    table = None if state is None else state.prompt_logprobs
    return None if table is None else tuple(table)
