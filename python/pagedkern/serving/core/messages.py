"""The messages between the HTTP front end and the engine core, defined once for both sides.

Each message is a dataclass; on the wire (channel.py) it is one msgpack array, its tag first,
then its fields in the order they are declared here (nested messages as arrays of their own
fields, without a tag). `to_wire` and `from_wire` are the two halves of that mapping, next to
the fields they map, so the two sides cannot drift apart.

Front end -> core (`FrontMessage`):
    Add(requests)           the requests submitted in one event-loop iteration (AddRequest each)
    Abort(request_id, alone)  an engine request id (an n > 1 sample's: "id.i"); alone: an
                            n > 1 request's first sample only, not the others
    StatsQuery(query_id)    -> Stats(query_id, gauges)
    Stop()                  abort everything, answer, exit
Core -> front end (`CoreMessage`):
    Ready(info)             once, after loading
    Failed(message)         loading failed; the core exits
    Added(request_id, prompt_tokens) / Refused(request_id, code, message)
    StepOutputs(outputs, request_ids, token_ids)   one per step (or a heartbeat: empty)
    Stats(query_id, gauges)
    Dead(reason, gauges)    the core stopped (gauges: its last reading, or None)

Validation happens once, at the front end: an AddRequest carries SamplingParams the front end
has built (and so checked). The core rebuilds them without their checks and bounds only what
could corrupt its memory or fail a step (`check_bounds`: sizes, lengths and the types of the
sampler's numbers here; token ids, the prompt's length and the request id in
Engine.add_request), so bad parameters from a broken front end cost their request, not the
process; a frame that is no message is dropped (channel.decode: ValueError).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from ...engine import SamplingParams
from ...engine.outputs import RequestOutput, TokenLogprob
from ...engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_LIST,
)


class Message:
    """A message's wire form: [TAG, *fields] (subclasses with nested fields override both)."""

    TAG: ClassVar[str]
    __slots__ = ()

    def to_wire(self) -> list:
        return [self.TAG, *[getattr(self, f) for f in self.__slots__]]

    @classmethod
    def from_wire(cls, frame: list):
        return cls(*frame[1:])


# --- the parts ---------------------------------------------------------------------------------

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_STOP = _PARAM_FIELDS.index("stop")


def params_to_wire(params: SamplingParams) -> list:
    """SamplingParams' fields in declared order, `stop` left empty (the front end matches stop
    strings; the core's requests have none)."""
    values = [getattr(params, name) for name in _PARAM_FIELDS]
    values[_STOP] = ()
    bias = params.logit_bias
    if bias is not None:
        values[_PARAM_FIELDS.index("logit_bias")] = dict(bias)
    return values


def params_from_wire(values: list) -> SamplingParams:
    """The front end's SamplingParams again, without re-running their checks (they ran there):
    the sequences as the tuples and the bias as the read-only map SamplingParams keeps, then
    `check_bounds`. Raises ValueError (-> the request is refused as invalid)."""
    if len(values) != len(_PARAM_FIELDS):
        raise ValueError(
            f"sampling parameters: {len(values)} fields, expected {len(_PARAM_FIELDS)}"
        )
    fields = dict(zip(_PARAM_FIELDS, values))
    for name in ("stop", "stop_token_ids"):
        fields[name] = tuple(fields[name])
    if fields["allowed_token_ids"] is not None:
        fields["allowed_token_ids"] = tuple(fields["allowed_token_ids"])
    fields["bad_words"] = tuple(tuple(word) for word in fields["bad_words"])
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = MappingProxyType(dict(fields["logit_bias"]))
    params = object.__new__(SamplingParams)  # (frozen: as its own __post_init__ sets fields)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    check_bounds(params)
    return params


def _count(name: str, value, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name}: {value!r} is not an integer in [{low}, {high}]")


_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_p")  # fmt: skip
_INT64 = 2**63


def check_bounds(params: SamplingParams) -> None:
    """What would corrupt the core's memory or fail a step (and so every request in it), not
    the API's rules: the sizes the core sizes its work and buffers by (samples, logprobs,
    lengths of the token lists) and the types of the numbers the sampler computes with (finite
    floats, int64 seed). Token ids are checked against the vocabulary by Engine.add_request."""
    for name in _FLOATS:
        value = getattr(params, name)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"{name}: {value!r} is not a finite number")
    if params.seed is not None:
        _count("seed", params.seed, -_INT64, _INT64 - 1)
    _count("top_k", params.top_k, -(2**31), 2**31 - 1)
    if type(params.ignore_eos) is not bool:
        raise ValueError(f"ignore_eos: {params.ignore_eos!r} is not a boolean")
    _count("n", params.n, 1, MAX_N)
    _count("max_tokens", params.max_tokens, 1, 2**31 - 1)
    _count("min_tokens", params.min_tokens, 0, params.max_tokens)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            _count(name, value, 0, MAX_LOGPROBS)
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: more than {MAX_STOP_TOKEN_IDS}")
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if len(getattr(params, name) or ()) > MAX_TOKEN_LIST:
            raise ValueError(f"{name}: more than {MAX_TOKEN_LIST} entries")
    if any(not 1 <= len(word) <= MAX_STOP_STRING_LENGTH for word in params.bad_words):
        raise ValueError(f"bad_words: each 1 to {MAX_STOP_STRING_LENGTH} ids")


def _logprobs_to_wire(logprobs) -> list:
    return [[lp.token_id, lp.logprob, lp.top] for lp in logprobs]


def _logprob_from_wire(entry) -> TokenLogprob:
    return TokenLogprob(entry[0], entry[1], tuple(map(tuple, entry[2])))


@dataclass(slots=True)
class AddRequest:
    request_id: str  # the id the front end admits it under
    prompt_ids: list[int]
    params: SamplingParams | None  # built (and checked) by the front end; `stop` not sent
    # the core's side: why the parameters that came are out of bounds (params is None then)
    invalid: str | None = None

    def to_wire(self) -> list:
        return [self.request_id, self.prompt_ids, params_to_wire(self.params)]


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the front end needs to know about the engine, once (in Ready)."""

    model: str | None  # the engine's model spec (None: the default model)
    max_model_len: int
    vocab_size: int
    max_queue: int
    description: str  # the --trace / --stats model line


@dataclass(slots=True)
class EngineGauges:
    """Engine state at one moment, read in the engine core (metrics.py renders them)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    spec_steps: int = 0  # speculative decoding, since the engine started (EngineStats)
    spec_proposed: int = 0
    spec_accepted: int = 0
    # shadow mode (ops/shadow.py ShadowReport.rows): [op, layer or -1, calls, max relative
    # error, divergences] per op and layer; None when it is off
    shadow: list | None = None
    # per-kind KV block tables (hybrid local/global models): [kind, blocks in use, peak] per
    # layer kind; None with one table
    kv_blocks_by_kind: list | None = None


def _gauges_to_wire(gauges: EngineGauges | None) -> list | None:
    return None if gauges is None else [getattr(gauges, f) for f in EngineGauges.__slots__]


def _gauges_from_wire(values: list | None) -> EngineGauges | None:
    return None if values is None else EngineGauges(*values)


@dataclass(slots=True)
class SampleDelta:
    """One sample's step delta, for every output but the plain decode tokens (those travel in
    StepOutputs' two columns)."""

    key: str  # the id the front end admitted (an n > 1 sample's parent's)
    index: int  # the sample
    token_ids: list[int]
    finish: str | None  # a FinishReason value, once it finishes
    error: str | None
    logprobs: tuple[TokenLogprob, ...] | None
    # echo + logprobs: the prompt's ids and per-token logprobs, once, with the finishing delta
    prompt_ids: list[int] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> SampleDelta:
        """The delta of one engine output."""
        return cls(
            out.parent_id or out.request_id,
            out.index,
            out.token_ids,
            out.finish_reason.value if out.finished else None,
            out.error,
            out.logprobs,
            None if out.prompt_logprobs is None else out.prompt_token_ids,
            out.prompt_logprobs,
        )

    def to_wire(self) -> list:
        logprobs = None if self.logprobs is None else _logprobs_to_wire(self.logprobs)
        prompt = None
        if self.prompt_logprobs is not None:
            table = [None if lp is None else [lp.token_id, lp.logprob, lp.top]
                     for lp in self.prompt_logprobs]  # fmt: skip
            prompt = [self.prompt_ids, table]
        return [self.key, self.index, self.token_ids, self.finish, self.error, logprobs, prompt]

    @classmethod
    def from_wire(cls, row: list) -> SampleDelta:
        key, index, ids, finish, error, logprobs, prompt = row
        if logprobs is not None:
            logprobs = tuple(map(_logprob_from_wire, logprobs))
        if prompt is None:
            return cls(key, index, ids, finish, error, logprobs)
        table = tuple(None if e is None else _logprob_from_wire(e) for e in prompt[1])
        return cls(key, index, ids, finish, error, logprobs, prompt[0], table)


# --- front end -> core -------------------------------------------------------------------------


@dataclass(slots=True)
class Add(Message):
    TAG = "add"
    requests: list[AddRequest]

    def to_wire(self) -> list:
        return [self.TAG, [r.to_wire() for r in self.requests]]

    @classmethod
    def from_wire(cls, frame: list) -> Add:
        """(A request whose parameters are out of bounds comes with `invalid` saying why and no
        params: the core refuses it alone.)"""
        requests = []
        for request_id, prompt_ids, values in frame[1]:
            try:
                requests.append(AddRequest(request_id, prompt_ids, params_from_wire(values)))
            except (ValueError, TypeError) as exc:
                requests.append(AddRequest(request_id, prompt_ids, None, str(exc)))
        return cls(requests)


@dataclass(slots=True)
class Abort(Message):
    TAG = "abort"
    request_id: str
    alone: bool = False  # Engine.abort's: the first sample of an n > 1 request only


@dataclass(slots=True)
class StatsQuery(Message):
    TAG = "stats?"
    query_id: int


@dataclass(slots=True)
class Stop(Message):
    TAG = "stop"


# --- core -> front end -------------------------------------------------------------------------


@dataclass(slots=True)
class Ready(Message):
    TAG = "ready"
    info: CoreInfo

    def to_wire(self) -> list:
        info = self.info
        return [self.TAG, [getattr(info, f.name) for f in dataclasses.fields(info)]]

    @classmethod
    def from_wire(cls, frame: list) -> Ready:
        return cls(CoreInfo(*frame[1]))


@dataclass(slots=True)
class Failed(Message):
    TAG = "failed"
    message: str


@dataclass(slots=True)
class Added(Message):
    TAG = "added"
    request_id: str
    prompt_tokens: int


@dataclass(slots=True)
class Refused(Message):
    TAG = "refused"
    request_id: str
    code: str  # queue_full, context_length_exceeded, invalid or error
    message: str


@dataclass(slots=True)
class StepOutputs(Message):
    """One step's deltas: the outputs, and the plain decodes' tokens that end nothing (sample 0,
    nothing else to say) as two columns, request_ids[i] made token_ids[i]; a request is in one
    of the two parts at most."""

    TAG = "outputs"
    outputs: list[SampleDelta]
    request_ids: list[str]
    token_ids: list[int]

    def to_wire(self) -> list:
        return [self.TAG, [d.to_wire() for d in self.outputs], self.request_ids, self.token_ids]

    @classmethod
    def from_wire(cls, frame: list) -> StepOutputs:
        _, rows, request_ids, token_ids = frame
        if len(request_ids) != len(token_ids):
            raise ValueError("StepOutputs: the two columns differ in length")
        return cls([SampleDelta.from_wire(row) for row in rows], request_ids, token_ids)


@dataclass(slots=True)
class Stats(Message):
    TAG = "stats"
    query_id: int
    gauges: EngineGauges

    def to_wire(self) -> list:
        return [self.TAG, self.query_id, _gauges_to_wire(self.gauges)]

    @classmethod
    def from_wire(cls, frame: list) -> Stats:
        return cls(frame[1], _gauges_from_wire(frame[2]))


@dataclass(slots=True)
class Dead(Message):
    TAG = "dead"
    reason: str
    gauges: EngineGauges | None  # the last reading (None: the engine could not give one)

    def to_wire(self) -> list:
        return [self.TAG, self.reason, _gauges_to_wire(self.gauges)]

    @classmethod
    def from_wire(cls, frame: list) -> Dead:
        return cls(frame[1], _gauges_from_wire(frame[2]))


FrontMessage = Add | Abort | StatsQuery | Stop
CoreMessage = Ready | Failed | Added | Refused | StepOutputs | Stats | Dead
BY_TAG: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        Add,
        Abort,
        StatsQuery,
        Stop,
        Ready,
        Failed,
        Added,
        Refused,
        StepOutputs,
        Stats,
        Dead,
    )  # fmt: skip
}
