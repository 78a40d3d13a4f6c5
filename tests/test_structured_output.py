"""Structured output on the default model: response_format json_schema / json_object through
llguidance's per-token bitmasks applied in the sampling op. Every finished output parses and
validates against its schema (jsonschema, test-only); max_tokens cutting it short is `length`.
The 20 schemas are batched into one engine run (small, bounded schemas keep CI time modest)."""

from __future__ import annotations

import json

import pytest

from pagedkern.engine import Engine, EngineConfig, FinishReason, SamplingParams

jsonschema = pytest.importorskip("jsonschema")  # test-only dependency


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": NAME, "country": {"enum": ["France", "Spain", "Italy"]}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"colour": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer", "maximum": 9}}),
    obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"const": "EUR"}}),
    obj({"user": obj({"id": {"type": "integer"}, "name": NAME}), "active": {"type": "boolean"}}),
    obj({"word": {"type": "string", "maxLength": 8}}, required=["word"]),
    obj({"greeting": {"type": "string", "maxLength": 10, "pattern": "^[^a-zA-Z0-9]*[éàüñ].*$"}}),
    obj({"scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}),
    obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                "maxItems": 2,
            }
        }
    ),
    obj({"a": {"type": "integer"}, "b": {"type": ["string", "null"], "maxLength": 6}}),
    obj({"status": {"enum": ["open", "closed", 3, None]}}),
    obj(
        {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
        required=["title"],
    ),
    obj({"emoji": {"type": "string", "minLength": 1, "maxLength": 4}}),
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3},
    obj({"inner": obj({"deep": obj({"v": {"type": "boolean"}})})}),
    obj({"when": {"type": "string", "maxLength": 10, "pattern": "^[0-9]{4}-[0-9]{2}$"}}),
    {"enum": ["yes", "no", "maybe"]},
]
assert len(SCHEMAS) == 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_config(EngineConfig(backend="reference", kv_cache_gib=0.25))


def _format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.slow  # 20 schemas x 48 tokens; one schema x 16 samples stays fast (below)
def test_twenty_schemas_parse_and_validate(engine):
    ids = []
    for i, schema in enumerate(SCHEMAS):
        params = SamplingParams(
            max_tokens=48, temperature=0.8, seed=i, response_format=_format(schema)
        )
        question = [{"role": "user", "content": f"Answer in JSON: item {i}."}]
        ids.append(engine.add_request(messages=question, params=params).request_id)
    texts = {rid: "" for rid in ids}
    reasons = {}
    for out in engine.run_until_done():
        texts[out.request_id] += out.text
        if out.finished:
            reasons[out.request_id] = out.finish_reason
    for rid, schema in zip(ids, SCHEMAS, strict=True):
        assert reasons[rid] is FinishReason.STOP, (rid, texts[rid], schema)
        jsonschema.validate(json.loads(texts[rid]), schema)
    assert engine.pool.num_used == 0


def test_json_object_streamed_and_cut_short(engine):
    fmt = {"type": "json_object"}
    chat = [{"role": "user", "content": "A JSON object about cats, please."}]
    outs = list(
        engine.stream(
            messages=chat,
            params=SamplingParams(max_tokens=40, temperature=0, response_format=fmt, n=1),
        )
    )
    text = "".join(o.text for o in outs)
    if outs[-1].finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(text), dict)
    else:
        assert outs[-1].finish_reason is FinishReason.LENGTH
    short = list(
        engine.stream(
            messages=chat,
            params=SamplingParams(max_tokens=3, temperature=0, response_format=_format(SCHEMAS[0])),
        )
    )
    assert short[-1].finish_reason is FinishReason.LENGTH
    assert text.startswith("{") and "".join(o.text for o in short).startswith("{")


@pytest.mark.parametrize("fmt", [{"type": "json_schema"}, {"type": "xml"}, "json"])
def test_malformed_formats_are_a_value_error_naming_response_format(fmt):
    with pytest.raises(ValueError, match="response_format"):
        SamplingParams(response_format=fmt)


def _optional(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
UNFIT = {
    "objekt": ({"type": "objekt"}, "invalid JSON schema"),
    "bad pattern": ({"type": "string", "pattern": "("}, "invalid JSON schema"),
    # compile, but exceed llguidance's limits once generation starts
    "a{1000000}": ({"type": "string", "pattern": "^a{1000000}$"}, "limits"),
    "recursive required $ref": (RECURSIVE, "limits"),
    "1000 optional properties": (_optional(1000), "limits"),
    # admit no JSON value at all: the answer was "" (not JSON)
    "$ref #": ({"$ref": "#"}, "admits no value"),
    "$ref cycle": (CYCLE, "admits no value"),
}


@pytest.mark.parametrize("name", list(UNFIT))
def test_unfit_schemas_are_refused_at_admission_with_a_short_message(engine, name):
    """Schemas that compile but cannot be generated within llguidance's limits (before: a
    failure per sample while generating, each message carrying the whole grammar) or that admit
    no value (before: an empty answer, not JSON) are a ValueError naming response_format when
    the request is added; nothing is left running."""
    schema, why = UNFIT[name]
    params = SamplingParams(max_tokens=8, n=4, response_format=_format(schema))
    with pytest.raises(ValueError, match=f"^response_format: .*{why}") as refused:
        engine.add_request(prompt_ids=[1, 2, 3], params=params)
    assert len(str(refused.value)) < 500
    assert not engine.has_unfinished and engine.pool.num_used == 0
    with pytest.raises(ValueError, match="^response_format"):  # again: the refusal is cached
        engine.add_request(prompt_ids=[1, 2, 3], params=params)


class CountingMatcher:
    """llguidance.LLMatcher, counting the matchers built (each one compiles the grammar)."""

    def __init__(self, real):
        self.real, self.built = real, 0

    def __call__(self, *args, **kwargs):
        self.built += 1
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_the_samples_of_a_request_share_one_compile(engine, monkeypatch):
    """n = 16 samples: the schema is compiled once (before: one matcher built per sample, each
    a full compile: 64 x 0.18 s for an 83 KB schema); each sample's matcher is a copy that
    advances alone, so every answer still parses and validates."""
    import llguidance

    counting = CountingMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    schema = obj({"shared": NAME, "count": {"type": "integer", "minimum": 0, "maximum": 99}})
    params = SamplingParams(max_tokens=48, temperature=1.0, n=16, response_format=_format(schema))
    chat = [{"role": "user", "content": "JSON please."}]
    engine.add_request(messages=chat, params=params)
    assert counting.built == 1
    texts, reasons = {}, {}
    for out in engine.run_until_done():
        texts[out.index] = texts.get(out.index, "") + out.text
        if out.finished:
            reasons[out.index] = out.finish_reason
    assert sorted(reasons) == list(range(16))
    assert all(r is FinishReason.STOP for r in reasons.values()), (reasons, texts)
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts.values())) > 1  # the copies did not share a position
    assert counting.built == 1 and engine.pool.num_used == 0


def test_a_limit_met_while_generating_fails_the_request_alone_with_a_short_error(engine):
    """A schema whose first tokens pass the admission probe but whose later part exceeds
    llguidance's limits: that request ends with an error naming response_format, a few hundred
    characters (before: a RuntimeError carrying the whole grammar, logged per sample), and the
    request beside it completes."""
    schema = obj({"a": {"type": "string", "minLength": 24, "maxLength": 24}, "b": _optional(1000)})
    bad = engine.add_request(
        prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=64, response_format=_format(schema))
    )
    # ignore_eos: an unseeded sample that drew EOS would end with "stop" before its 8 tokens
    good = engine.add_request(
        prompt_ids=[4, 5, 6], params=SamplingParams(max_tokens=8, ignore_eos=True)
    )
    finals = {o.request_id: o for o in engine.run_until_done() if o.finished}
    assert finals[bad.request_id].finish_reason is FinishReason.ERROR
    error = finals[bad.request_id].error
    assert error.startswith("StructuredOutputError: response_format: ") and len(error) < 500
    assert finals[good.request_id].finish_reason is FinishReason.LENGTH
    assert engine.pool.num_used == 0
