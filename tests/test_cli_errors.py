"""`pagedkern-serve` on bad input, on synthetic:tiny: every bad flag or stdin line is one line on
stderr and exit status 2, never a traceback; a bad stdin line names its number and the other
lines are still answered; Ctrl-C exits 130 with what was generated so far; a reader that stops
early (`| head -c 5`) is no BrokenPipeError. The signal and pipe cases, and one bad flag, run a
real process; the other bad input runs main() in this one (what a process would print and exit
with: main() turns every error into a line and SystemExit(2) itself). A flag typed where the
others leave it without effect is refused by the parser alone (no model loads), and --device
cuda without a visible GPU before the model loads."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys

import pytest
import torch

from pagedkern.model.spec import ModelSpec
from pagedkern.serving.cli import main
from pagedkern.serving.cli.args import build_parser
from pagedkern.serving.cli.config_from_flags import engine_config

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


# A flag typed where the others leave it without effect, and the flags named in the error.
POINTLESS_FLAGS = [
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens", "--speculative"),
    (["--speculative", "none", "--num-speculative-tokens", "4"], "--num-speculative-tokens", ""),
    (["--ngram-min", "1"], "--ngram-min", "--speculative ngram"),
    (["--speculative", "draft", "--draft-model", "self:1", "--ngram-max", "3"], "--ngram-max", ""),
    (["--draft-model", "self:1"], "--draft-model", "--speculative draft"),
    (["--speculative", "ngram", "--draft-model", "self:1"], "--draft-model", ""),
    (["--expert-parallel"], "--expert-parallel", "--tensor-parallel-size 1"),
    (["--tensor-parallel-size", "1", "--expert-parallel"], "--expert-parallel", ""),
    (["--served-model-name", "m"], "--served-model-name", "--http"),
    (["--port", "8000"], "--port", "--http"),  # typed, though it is the default
    (["--host", "127.0.0.1"], "--host", "--http"),
    (["--api-key", "k"], "--api-key", "--http"),
    (["--allowed-origins", "*"], "--allowed-origins", "--http"),
    (["--max-body-bytes", "100"], "--max-body-bytes", "--http"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser", "--http"),
    (["--core-threads", "2"], "--core-threads", "--http"),
    (["--max-queue", "3"], "--max-queue", "--http"),
    (["--grammar-compile-workers", "3"], "--grammar-compile-workers", "--http"),
    (["--raw", "--system", "s"], "--system", "--raw"),
    (["--num-blocks", "16", "--kv-cache-gib", "2"], "--kv-cache-gib", "--num-blocks"),
    (["--num-blocks", "16", "--gpu-memory-fraction", "0.5"], "--gpu-memory-fraction", ""),
    (["--num-spec=3"], "--num-speculative-tokens", ""),  # an abbreviation is typed too
]
HTTP_POINTLESS_FLAGS = [
    (["--http", "--system", "s"], "--system", "--http"),
    (["--http", "--raw"], "--raw", "--http"),
]


def refusal(argv: list[str], capsys) -> str:
    """The parser's one-line error for `argv` (exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    return one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("args,flag,other", POINTLESS_FLAGS)
def test_a_flag_without_effect_is_refused_naming_both_flags(args, flag, other, capsys):
    line = refusal([*args, "hi"], capsys)
    assert flag in line and "has no effect" in line and other in line, line


@pytest.mark.parametrize("args,flag,other", HTTP_POINTLESS_FLAGS)
def test_a_prompt_only_flag_is_refused_with_http(args, flag, other, capsys):
    line = refusal(args, capsys)
    assert flag in line and "has no effect with --http" in line, line


def test_main_refuses_a_flag_without_effect_before_loading(capsys, monkeypatch):
    status, out, err = run_main(capsys, monkeypatch, "--served-model-name", "m", "hi")
    assert status == 2 and out == ""
    assert "--served-model-name has no effect without --http" in one_error_line(err)


@pytest.mark.parametrize(
    "args",
    [
        [],  # every default: none of them counts as typed
        ["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1"],
        ["--speculative", "ngram", "--ngram-max", "3"],
        ["--speculative", "draft", "--draft-model", "self:1", "--num-speculative-tokens", "2"],
        ["--tensor-parallel-size", "2", "--expert-parallel"],
        ["--num-blocks", "16"],
        ["--kv-cache-gib", "2", "--gpu-memory-fraction", "0.5"],
        ["--system", "s"],
        ["--raw", "--max-tokens", "3", "--log-level", "info"],
    ],
)
def test_flags_that_take_effect_still_parse(args):
    build_parser().parse_args([*args, "hi"])


def test_http_flags_still_parse_with_http():
    args = build_parser().parse_args(
        ["--http", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "m"]
        + ["--api-key", "k", "--allowed-origins", "*", "--max-queue", "3", "--core-threads", "2"]
        + ["--grammar-compile-workers", "3", "--tool-call-parser", "hermes", "--max-tokens", "5"]
    )
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 8000, "m")


def test_typed_flags_are_the_given_ones_not_the_defaults():
    parser = build_parser()
    assert parser.typed(["hi"]) == {"prompt"}
    assert parser.typed(["--port", "8000", "--stop", "x", "--no-prefix-caching"]) == {
        "port",
        "stop",
        "no_prefix_caching",
    }
    assert parser.parse_args(["hi"]).port == 8000  # the defaults are back after typed()


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_without_a_visible_gpu_is_one_line(device, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=f"--device {device}: no CUDA GPU is visible"):
        engine_config(build_parser().parse_args(["--device", device, "hi"]))
    for mode in (["hi"], ["--http", "--port", "0"]):  # before the model loads, or the server
        status, out, err = run_main(capsys, monkeypatch, "--device", device, *mode)
        assert status == 2 and out == ""
        assert "torch.cuda.is_available() is False" in one_error_line(err)


def test_device_names_a_gpu_torch_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    parse = build_parser().parse_args
    assert engine_config(parse(["--device", "cuda:0", "hi"])).device == "cuda:0"
    assert engine_config(parse(["--device", "cuda", "hi"])).device == "cuda"
    with pytest.raises(ValueError, match=r"--device cuda:1: no such GPU \(torch sees 1"):
        engine_config(parse(["--device", "cuda:1", "hi"]))
    assert engine_config(parse(["--device", "cpu", "hi"])).device == "cpu"
    with pytest.raises(ValueError, match="--device nope"):
        engine_config(parse(["--device", "nope", "hi"]))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--backend", "cuda", "--device", "cpu"], "backend 'cuda' runs the CUDA kernels only"),
        (["--backend", "cpu", "--device", "cuda"], "backend 'cpu' runs on the CPU only"),
        (["--device", "meta"], "device must be a CPU or CUDA device, got 'meta'"),
    ],
)
def test_a_device_the_backend_cannot_use_is_refused_before_the_model_loads(
    flags, message, capsys, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda passes alone
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(ModelSpec, "load", load)
    status, out, err = run_main(capsys, monkeypatch, *flags, "hi")
    assert status == 2 and out == ""
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
