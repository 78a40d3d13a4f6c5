"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

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
# OpenAI's ranges: penalties in [-2, 2], biases in [-100, 100], at most 20 top logprobs.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 10.0  # (0, 10]: 1 = off; vLLM allows any > 0, 10 already bans repeats
MAX_N = 64  # samples per request
MAX_TOKEN_LIST = 65536  # logit_bias / allowed_token_ids / bad_words entries (host work bound)
# response_format: its shape is checked here; its schema's meaning when it is compiled
# (structured_output.GrammarCompiler).
FORMAT_TYPES = ("text", "json_object", "json_schema", "grammar")
MAX_SCHEMA_CHARS = 100_000  # bounds grammar compilation time per request


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings; validated on construction (the error names the field:
    ValueError for a value out of range, ParameterTypeError, a TypeError and ValueError, for a
    wrong type).

    max_tokens in [1, 2^31). temperature in [0, 2] (0 means greedy). top_p in (0, 1] (1 = off);
    top_k an int32, <= 0 = off. `seed` (an int64) makes the request's draws reproducible whatever
    else shares its batches, with speculative decoding or without (None: the engine picks one).
    Stop conditions: the model's end-of-turn / EOS tokens (unless ignore_eos), `stop_token_ids`
    (at most 1024), `stop` strings (at most 64, each 1..256 characters; never emitted, not even
    partly), `max_tokens`, the model's context length, `timeout` seconds after arrival, and
    cancellation by the caller. `stop` and `stop_token_ids` are stored as tuples. Immutable
    (one object may serve many requests; `dataclasses.replace` makes a checked variant).

    Logits processing (semantics: pagedkern.reference.logits_processing): presence_penalty and
    frequency_penalty in [-2, 2] over the generated tokens (OpenAI); repetition_penalty in
    (0, 10] over prompt + generated tokens (HF / vLLM; 1 = off); logit_bias {token id: bias in
    [-100, 100]}; allowed_token_ids (only these may be sampled); bad_words (token id
    sequences that are never completed); min_p in [0, 1]; min_tokens (EOS and stop ids masked
    until that many tokens are generated, <= max_tokens). Token ids are checked against the
    vocabulary at admission. logprobs: None, or N in [0, 20]: the sampled token's log
    probability and the N most likely, from the processed distribution (after penalties, bias,
    masks and temperature; before min-p / top-k / top-p). prompt_logprobs: None, or N in
    [0, 20]: each prompt token's log probability given the tokens before it and the N most
    likely there, from the raw model logits (temperature 1, no processing, as vLLM; the
    request's prompt is then computed whole, without prefix-cache hits). n in [1, 64]
    samples that share the prompt's KV blocks, sample i seeded with seed + i.
    response_format: None, {"type": "text"}, {"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": ...}} (also the bare schema): structured output
    (engine.structured_output); its shape is checked here, the schema when it is compiled
    (Engine.add_request: a ValueError naming response_format).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[Sequence[int]] = field(default_factory=tuple)
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    response_format: Mapping | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_number(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"
                )
        rep = check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < rep <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {rep}"
            )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(check_token_ids("allowed_token_ids", self.allowed_token_ids))
            if not allowed or len(allowed) > MAX_TOKEN_LIST:
                raise ValueError(
                    f"allowed_token_ids: 1 to {MAX_TOKEN_LIST} ids, got {len(allowed)}"
                )
            object.__setattr__(self, "allowed_token_ids", allowed)
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        min_p = check_number("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        check_int("n", self.n, 1, MAX_N)
        if self.response_format is not None:
            object.__setattr__(self, "response_format", check_response_format(self.response_format))

    def token_ids_used(self) -> list[tuple[str, int]]:
        """(field, id) for every token id the parameters name, to check against a vocabulary."""
        used = [("stop_token_ids", i) for i in self.stop_token_ids]
        used += [("logit_bias", i) for i in self.logit_bias or ()]
        used += [("allowed_token_ids", i) for i in self.allowed_token_ids or ()]
        used += [("bad_words", i) for word in self.bad_words for i in word]
        return used

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

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


def _logit_bias(bias) -> Mapping[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ParameterTypeError(f"logit_bias must be a map of token id to bias, got {bias!r}")
    if len(bias) > MAX_TOKEN_LIST:
        raise ValueError(f"logit_bias: at most {MAX_TOKEN_LIST} entries, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit():
            if len(key) > 20:  # (past int64; int() refuses 4300+ digits)
                raise ValueError(f"logit_bias: a key of {len(key)} digits is not a token id")
            key = int(key)  # JSON object keys are strings (OpenAI sends {"50256": -100})
        token = check_token_ids("logit_bias", [key])[0]
        value = check_number(f"logit_bias[{token}]", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value}"
            )
        out[token] = value
    return MappingProxyType(out)  # read-only: the checks cannot be bypassed


def _bad_words(words) -> tuple[tuple[int, ...], ...]:
    if isinstance(words, (str, bytes, Mapping)) or not isinstance(words, Sequence):
        raise ParameterTypeError(f"bad_words must be a list of token id lists, got {words!r}")
    if len(words) > MAX_TOKEN_LIST:
        raise ValueError(f"bad_words: at most {MAX_TOKEN_LIST} sequences, got {len(words)}")
    out = []
    for i, word in enumerate(words):
        ids = tuple(check_token_ids(f"bad_words[{i}]", word))
        if not 1 <= len(ids) <= MAX_STOP_STRING_LENGTH:
            raise ValueError(f"bad_words[{i}] must have 1 to {MAX_STOP_STRING_LENGTH} ids")
        out.append(ids)
    return tuple(out)


def check_response_format(value: Any) -> Mapping | None:
    """A checked, normalised response_format ({"type": ..., "schema": ...}); None for text.
    ValueError naming response_format for a malformed value. The schema's meaning is checked
    when it is compiled (`GrammarCompiler.compile`), not here: this runs on event loops."""
    if not isinstance(value, Mapping):
        raise ParameterTypeError(f"response_format must be an object, got {value!r}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"response_format.type must be one of {FORMAT_TYPES}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "grammar":  # a Lark grammar for llguidance (the server's tool-call grammars)
        grammar = value.get("grammar")
        if not isinstance(grammar, str) or not grammar:
            raise ValueError("response_format.grammar must be a non-empty Lark grammar string")
        if len(grammar) > MAX_SCHEMA_CHARS:
            raise ValueError(f"response_format: the grammar has over {MAX_SCHEMA_CHARS} characters")
        return {"type": kind, "grammar": grammar}
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec if "type" in spec or "properties" in spec else None)
        if not isinstance(schema, (Mapping, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:  # not JSON data (a Python caller's object)
        raise ValueError(f"response_format: the schema is not JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"response_format: the schema has over {MAX_SCHEMA_CHARS} characters")
    return {"type": kind, "schema": json.loads(text, parse_int=_schema_integer)}


def _schema_integer(digits: str) -> int:
    """A schema's integer, within the signed 64 bits that the grammar engine and the wire to
    the engine core carry."""
    value = int(digits) if len(digits) <= 20 else 2**63  # (int() refuses 4300+ digits)
    if not -(2**63) <= value < 2**63:
        raise ValueError(
            f"response_format: the schema's integer {digits:.40} is outside the signed 64-bit range"
        )
    return value
