"""`pagedkern-serve` on bad input, on synthetic:tiny: every bad flag or stdin line is one line on
stderr and exit status 2, never a traceback; a bad stdin line names its number and the other
lines are still answered; Ctrl-C exits 130 with what was generated so far; a reader that stops
early (`| head -c 5`) is no BrokenPipeError. The signal and pipe cases, and one bad flag, run a
real process; the other bad input runs main() in this one (what a process would print and exit
with: main() turns every error into a line and SystemExit(2) itself)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys

import pytest

from pagedkern.serving.cli import main

ARGS = ["--model", "synthetic:tiny"]
CLI = [sys.executable, "-m", "pagedkern.serving.cli", *ARGS]
WAIT = 300


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, timeout=WAIT)


def run_main(capsys, monkeypatch, *args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    """main() in this process: (exit status, stdout, stderr). An exception other than
    SystemExit (a traceback in a process) fails the test."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    capsys.readouterr()
    try:
        status = main([*ARGS, *args])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkern-serve: error: "), err
    return lines[0]


BAD_FLAGS = [
    (["--seed", str(2**64)], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--top-k", str(2**31)], "--top-k"),
    (["--block-size", "0"], "--block-size"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    (["--kv-cache-gib", "nan"], "--kv-cache-gib"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-seqs", "-1"], "--max-num-seqs"),
    (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction"),
    (["--temperature", "inf"], "--temperature"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--dtype", "int8"], "--dtype"),
    (["--log-level", "loud"], "--log-level"),
    (["--no-such-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("args,message", BAD_FLAGS)
def test_bad_flags_exit_2_with_one_line(args, message, capsys, monkeypatch):
    status, _, err = run_main(capsys, monkeypatch, *args, "hi")
    assert status == 2
    assert message in one_error_line(err)


def test_a_bad_flag_in_a_real_process_is_one_line_and_status_2():
    proc = run("--kv-cache-gib", "nan", "hi")
    assert proc.returncode == 2
    assert "--kv-cache-gib" in one_error_line(proc.stderr.decode())


def test_bad_stdin_lines_are_reported_and_the_others_answered(capsys, monkeypatch):
    lines = [
        b"hello",
        json.dumps({"prompt": "x", "stop": 5}).encode(),
        json.dumps({"messages": [{"role": "user"}]}).encode(),
        b"caf\xff",
        b"{not json",
        json.dumps({"prompt": "y", "seed": 2**64}).encode(),
        json.dumps({"prompt": "y", "top_k": 2**31}).encode(),
        json.dumps({"prompt": 5}).encode(),
        b"[" * 100_000 + b"]" * 100_000,  # JSON nested past the recursion limit
        b'{"prompt": "y", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b'{"prompt": "y", "temperature": ' + str(2**1100).encode() + b"}",  # past float's range
        json.dumps({"prompt": "z", "max_tokens": 2, "ignore_eos": True}).encode(),
    ]
    stdin = b"\n".join(lines) + b"\n"
    status, out, err = run_main(capsys, monkeypatch, "--max-tokens", "3", "-", stdin=stdin)
    assert status == 2 and "Traceback" not in err, err
    reported = sorted(int(n) for n in __import__("re").findall(r"stdin line (\d+):", err))
    assert reported == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], err
    assert len(err.strip().splitlines()) == 10
    assert len(out.rstrip("\n").split("\n")) == 2  # lines 1 and 12 answered


def test_stdin_with_only_bad_lines_exits_2_before_loading(capsys, monkeypatch):
    status, out, err = run_main(capsys, monkeypatch, "-", stdin=b"\xff\xfe\n")
    assert status == 2 and "Traceback" not in err
    assert out == ""


def _default_sigint() -> None:
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, and
    # so would the CLI (Python then installs no KeyboardInterrupt handler): a terminal's Ctrl-C
    # reaches a CLI whose SIGINT is at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_and_prints_what_was_generated():
    # stdin mode prints whole answers at the end: Ctrl-C must still print the partial ones.
    line = json.dumps({"prompt": "go", "max_tokens": 100000, "ignore_eos": True})
    proc = subprocess.Popen(
        [*CLI, "--backend", "reference", "--trace", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    )
    try:
        proc.stdin.write(f"{line}\n{line}\n".encode())
        proc.stdin.close()
        proc.stdin = None  # communicate() must not flush it
        streamed = {b"R0": 0, b"R1": 0}
        for trace in proc.stderr:  # --trace: a request's second "streams" line comes a step
            name = trace.split()[0] if trace.strip() else b""  # after its first text arrived
            if b" streams " in trace and name in streamed:
                streamed[name] += 1
                if min(streamed.values()) >= 2:
                    break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err[-2000:]
    answers = out.decode().split("\n")[:2]
    assert all(answers), out  # both partial answers, in order


def test_ctrl_c_while_streaming_one_prompt_exits_130():
    proc = subprocess.Popen(
        [*CLI, "--backend", "reference", "--max-tokens", "100000", "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    )
    try:
        first = proc.stdout.read(1)  # the answer has started streaming
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first and proc.returncode == 130
    assert b"Traceback" not in err, err[-2000:]
    assert out.endswith(b"\n")  # the partial answer's line is ended


def test_a_reader_that_stops_early_is_not_a_traceback():
    cmd = " ".join([*CLI, "--backend", "reference", "--max-tokens", "400", "hi"])
    proc = subprocess.run(
        f"{cmd} | head -c 5; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        timeout=WAIT,
    )
    assert len(proc.stdout) == 5
    assert b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_a_10_mb_stdin_line_is_refused_by_its_length(capsys, monkeypatch):
    stdin = b"x" * 10_000_000 + b"\n" + json.dumps({"prompt": "z", "max_tokens": 2}).encode()
    status, out, err = run_main(capsys, monkeypatch, "-", stdin=stdin)
    assert status == 2
    assert one_error_line(err).startswith(
        "pagedkern-serve: error: stdin line 1: the prompt has at least"
    )
    assert out.endswith("\n")  # line 2 answered (an answer is printed with its newline)
