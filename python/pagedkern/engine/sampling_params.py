"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings; validated on construction (ValueError names the field).

    temperature 0 means greedy. top_p in (0, 1] (1 = off); top_k <= 0 = off. `seed` makes the
    request's draws reproducible whatever else shares its batches (None: the engine picks one).
    Stop conditions: the model's end-of-turn / EOS tokens (unless ignore_eos), `stop_token_ids`,
    `stop` strings (never emitted, not even partly), `max_tokens`, the model's context length,
    `timeout` seconds after arrival, and cancellation by the caller.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1"),
            (_number(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int), "top_k must be an integer (<= 0: off)"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids: integers"),
            (
                self.timeout is None or (_number(self.timeout) and self.timeout > 0),
                "timeout must be a positive number of seconds",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
