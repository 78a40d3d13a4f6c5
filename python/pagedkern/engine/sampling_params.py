"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .validation import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    ParameterTypeError,
    check_bool,
    check_int,
    check_number,
    check_token_ids,
)

# Bounds on per-request work: stop matching costs O(number x length of the stop strings) per
# generated token, on the engine thread every other request waits on. OpenAI allows 4 stop
# strings; these limits are generous for real use and keep one request from slowing a step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 256
MAX_STOP_TOKEN_IDS = 1024
# The one rule for temperature, shared by the CLI, the HTTP API and Python: [0, 2] as OpenAI's
# API has it (above 2 a small model's distribution is noise; infinity would sample uniformly).
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings; validated on construction (the error names the field:
    ValueError for a value out of range, ParameterTypeError, a TypeError and ValueError, for a
    wrong type).

    max_tokens in [1, 2^31). temperature in [0, 2] (0 means greedy). top_p in (0, 1] (1 = off);
    top_k an int32, <= 0 = off. `seed` (an int64) makes the request's draws reproducible whatever
    else shares its batches (None: the engine picks one).
    Stop conditions: the model's end-of-turn / EOS tokens (unless ignore_eos), `stop_token_ids`
    (at most 1024), `stop` strings (at most 64, each 1..256 characters; never emitted, not even
    partly), `max_tokens`, the model's context length, `timeout` seconds after arrival, and
    cancellation by the caller. `stop` and `stop_token_ids` are stored as tuples. Immutable
    (one object may serve many requests; `dataclasses.replace` makes a checked variant).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    timeout: float | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        temperature = check_number("temperature", self.temperature)
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g}, got {temperature}"
            )
        top_p = check_number("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        check_int("top_k", self.top_k, INT32_MIN, INT32_MAX)
        if self.seed is not None:
            check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        stop_ids = tuple(check_token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(stop_ids)}")
        check_bool("ignore_eos", self.ignore_eos)
        if self.timeout is not None and check_number("timeout", self.timeout) <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _stop_strings(stop) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ParameterTypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ParameterTypeError(f"stop[{i}] must be a string, got {s!r}")
        if not 1 <= len(s) <= MAX_STOP_STRING_LENGTH:
            raise ValueError(
                f"stop[{i}] must have 1 to {MAX_STOP_STRING_LENGTH} characters, got {len(s)}"
            )
    return tuple(stop)
