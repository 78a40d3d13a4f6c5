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


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}},
        {"type": "json_schema"},
        {"type": "xml"},
        "json",
    ],
)
def test_invalid_formats_are_a_value_error_naming_response_format(fmt):
    with pytest.raises(ValueError, match="response_format"):
        SamplingParams(response_format=fmt)
