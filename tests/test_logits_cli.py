"""The CLI's issue-13 flags: --json-schema FILE constrains the answer (it parses and validates),
--logprobs N prints one line per token with N alternatives, --repetition-penalty is checked;
bad values exit 2 with a one-line error before the model loads."""

from __future__ import annotations

import json

import pytest

from pagedkern.serving.cli import main

jsonschema = pytest.importorskip("jsonschema")
TINY = ["--model", "synthetic:tiny", "--backend", "reference"]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": [1, 2]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_json_schema_logprobs_and_repetition_penalty(tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    argv = [*TINY, "--max-tokens", "30", "--logprobs", "2", "--repetition-penalty", "1.3"]
    assert main([*argv, "--json-schema", str(path), "hello"]) == 0
    out = capsys.readouterr()
    jsonschema.validate(json.loads(out.out), SCHEMA)
    lines = [ln for ln in out.err.splitlines() if ln.startswith("logprob ")]
    assert lines and all(ln.count("; ") == 1 for ln in lines)  # two alternatives per token


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--logprobs", "21"], "--logprobs"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--json-schema", "/nonexistent.json"], "--json-schema"),
    ],
)
def test_bad_flags_exit_2_naming_them(flags, field, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main([*TINY, *flags, "hello"])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err
