"""`pagedkern-serve` end to end on the CPU: the default model answers the capital question with
Paris, streaming (text reaches stdout while generation is still going); stdin batches answer in
input order; --trace narrates; bad arguments exit with status 2 and one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkern.serving.cli import main

CLI = [sys.executable, "-m", "pagedkern.serving.cli"]


def run(*args: str, stdin: str | None = None, merge: bool = False):
    return subprocess.run(
        [*CLI, *args],
        input=stdin,
        capture_output=not merge,
        text=True,
        timeout=600,
        stdout=subprocess.PIPE if merge else None,
        stderr=subprocess.STDOUT if merge else None,
    )


def test_capital_question_streams_paris():
    # --trace writes each iteration to stderr; merged into one pipe, the order of the writes
    # shows the answer's first words reached stdout before the last iteration ran.
    proc = run("--trace", "--stats", "What is the capital of France?", merge=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    out = proc.stdout
    assert "Paris" in out
    first_text = out.index("streams 'The'") if "streams 'The'" in out else out.index("streams")
    last_iteration = out.rindex("── iteration #")
    assert first_text < last_iteration
    assert "TTFT" in out and "tokens/s" in out
    assert "finished: stop" in out and "blocks freed" in out


def test_stdout_holds_only_the_answer():
    proc = run("--max-tokens", "20", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "The capital of France is Paris."


def test_many_prompts_from_stdin_answer_in_input_order():
    lines = [
        "What is the capital of France?",
        json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}),
        json.dumps({"prompt": "What is the capital of France?", "stop": ["Paris"]}),
    ]
    proc = run("--max-tokens", "20", "-", stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = proc.stdout.rstrip("\n").split("\n")
    assert len(answers) == 3
    assert answers[0] == "The capital of France is Paris."
    assert answers[2] == "The capital of France is "  # cut right before the stop string


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["--top-p", "1.5", "hi"], "top_p must be in (0, 1]"),
        (["--top-p", "0", "hi"], "top_p must be in (0, 1]"),
        (["   "], "the prompt is empty"),
        (["--model", "/no/such/model.gguf", "hi"], "/no/such/model.gguf"),
        (["--model", "synthetic:nope", "hi"], "unknown preset"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
