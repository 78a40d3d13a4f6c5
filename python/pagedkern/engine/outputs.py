"""What the engine hands out: immutable snapshots, never its live state.

A RequestOutput is one step's delta for one request plus a snapshot of the request at that
moment (prompt ids, output ids so far, metrics). Snapshots are O(1) to take: a request's output
ids and token times only ever grow, so a snapshot keeps a reference to those lists and its
length at the time, and reads only that prefix (as a tuple) when asked.

The engine makes one RequestOutput per request per step, so its construction is on the hot
path: it is a tuple subclass filled by one C-level `tuple.__new__` (~0.15 us; a frozen
dataclass costs ~7x that, and even a mutable slots object made frozen by a class assignment
~4x), its fields read through C-level item getters, and `metrics` is built from the snapshot
only when read (the HTTP engine core never reads it). Assignment raises FrozenInstanceError,
as on the frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field
from operator import itemgetter

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
        return cls(
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


# RequestOutput's tuple slots: its public fields, then the snapshot its metrics are built from
_PUBLIC = (
    "request_id",
    "text",
    "token_ids",
    "finished",
    "finish_reason",
    "prompt_token_ids",
    "error",
    "logprobs",
    "index",
    "parent_id",
    "prompt_logprobs",
)
_SNAPSHOT = (
    "arrival_time",
    "first_token_time",
    "finish_time",
    "num_output_tokens",
    "num_cached_tokens",
    "num_preemptions",
    "output_ids",  # the request's live list: read up to num_output_tokens
    "token_times",  # likewise
)
_new = tuple.__new__


class RequestOutput(tuple):
    """What one step produced for one request: `text` and `token_ids` are new since the last
    output; `prompt_token_ids`, `output_token_ids` (all so far) and `metrics` describe the
    request as it was then. `error` says why a request finished with FinishReason.ERROR.
    logprobs: for token_ids, when asked for; index: which of the request's n samples
    (request_id is the first's id + ".i"); parent_id: the request_id given at admission
    (n > 1); prompt_logprobs (SamplingParams.prompt_logprobs): per prompt token (None for the
    first), on the output that carries the first token and on the finishing one."""

    __slots__ = ()
    FIELDS = (*_PUBLIC[:6], "metrics", *_PUBLIC[6:])  # the public ones, in constructor order

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    prompt_token_ids: tuple[int, ...]
    error: str | None
    logprobs: tuple[TokenLogprob, ...] | None
    index: int
    parent_id: str | None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None

    def __new__(
        cls,
        request_id: str,
        text: str,
        token_ids: tuple[int, ...],
        finished: bool,
        finish_reason: FinishReason | None,
        prompt_token_ids: tuple[int, ...],
        metrics: RequestMetrics,
        error: str | None = None,
        output_ids: list[int] | None = None,
        logprobs: tuple[TokenLogprob, ...] | None = None,
        index: int = 0,
        parent_id: str | None = None,
        prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None,
    ) -> RequestOutput:
        m = metrics
        return _new(
            cls,
            (
                request_id,
                text,
                token_ids,
                finished,
                finish_reason,
                prompt_token_ids,
                error,
                logprobs,
                index,
                parent_id,
                prompt_logprobs,
                m.arrival_time,
                m.first_token_time,
                m.finish_time,
                m.num_output_tokens,
                m.num_cached_tokens,
                m.num_preemptions,
                [] if output_ids is None else output_ids,
                m._token_times,
            ),
        )

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
        output_ids = request.output_ids
        n = len(output_ids)
        state = request.logits_state
        table = None if state is None else state.prompt_logprobs
        return _new(
            cls,
            (
                request.request_id,
                text,
                token_ids,
                finished,
                finish_reason,
                request.prompt_ids,
                request.error,
                logprobs,
                request.sample_index,
                request.parent_id,
                # with the first token (the prompt is computed then) and again with the last
                None if table is None or not (finished or n == 1) else tuple(table),
                request.arrival_time,
                request.first_token_time,
                request.finish_time,
                n,
                request.num_cached_tokens,
                request.num_preemptions,
                output_ids,
                request.token_times,
            ),
        )

    @property
    def metrics(self) -> RequestMetrics:
        """The request's timings and counts at this output (built on each read)."""
        return RequestMetrics(
            self[11], self[12], self[13], len(self[5]), self[14], self[15], self[16], self[18]
        )

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self[17][: self[14]])

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple:
        return _new, (RequestOutput, tuple(self))

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _PUBLIC)
        return f"RequestOutput({shown})"


for _i, _name in enumerate(_PUBLIC):
    setattr(RequestOutput, _name, property(itemgetter(_i), doc=f"tuple slot {_i}"))
del _i, _name


@dataclass(slots=True)
class TokenDeltas:
    """A step's plainest deltas as two columns, for a consumer that wants no RequestOutput for
    them: the HTTP engine core sends them as they are (serving/core/channel.py). With
    Engine.token_deltas set, a decoding request's token that ends nothing and carries nothing
    else (no text, logprobs or prompt logprobs; not its first token; not an n > 1 sample) is
    recorded here instead of as an output; every other output is made as usual. Whoever sets
    it takes the columns after every step (step() no longer returns those tokens)."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def take(self) -> tuple[list[str], list[int]]:
        taken = self.request_ids, self.token_ids
        self.request_ids, self.token_ids = [], []
        return taken


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
    # per-kind block tables (hybrid local/global models): (kind, blocks in use, peak so far)
    kv_blocks_by_kind: tuple[tuple[str, int, int], ...] = ()

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
