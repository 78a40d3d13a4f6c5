"""CPU rehearsal of tools/gpu_check.sh, so that the first GPU run produces evidence.

Everything runs in subprocesses that see the GPU machine's image: the packages it lacks (the
HTTP stack, the OpenAI client, gguf) cannot be imported (tools/rehearsal/sitecustomize.py) and
PAGEDKERN_BENCH_SMOKE is unset. Each pytest stage of the script's own plan (--print-plan, from
tools/gpu_stages.txt) is collected with a pretended Hopper GPU (tools/rehearsal/pretend_gpu.py),
so module-level "is there a GPU" decisions take their GPU branch: benchmark suites leave smoke
mode, CPU-only suites skip. Any collection error fails. Then the script itself runs end to end
in --dry-run mode under the same blocked imports, and its time bounds are checked on a stage
that hangs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
# Not on the GPU machine's image (docs/GPU_CHECK.md); pydantic_core and starlette come with them.
GPU_IMAGE_LACKS = ("openai", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "gguf")
MAX_RESULT_FILES = 8  # the device tool returns at most 8 files


def gpu_image_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKERN_BENCH_")}
    path = [str(ROOT / "tools" / "rehearsal"), str(ROOT / "python")]
    env.update(
        PYTHONPATH=os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        PAGEDKERN_BLOCK_IMPORTS=",".join(GPU_IMAGE_LACKS),
        PYTHON=sys.executable,
        **extra,
    )
    return env


def plan(*flags: str, env: dict | None = None) -> list[dict]:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--print-plan", *flags],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    keys = ("name", "kind", "budget", "per_test", "args")
    return [dict(zip(keys, line.split("\t"), strict=True)) for line in proc.stdout.splitlines()]


def collect(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "pretend_gpu", *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=gpu_image_env(), capture_output=True, text=True, timeout=300
    )


FULL_PLAN = plan("--e2e")


def test_the_plan_runs_every_gpu_test_file_as_an_explicit_file():
    names = [s["name"] for s in FULL_PLAN]
    assert names[0] == "flash-prefill" and FULL_PLAN[0]["args"].split() == [
        "-x",
        "tests/test_flash_prefill_gpu.py",
    ]
    files = {f for s in FULL_PLAN if s["kind"] == "test" for f in s["args"].split()}
    gpu_files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*_gpu.py")}
    assert gpu_files <= files, f"GPU test files in no stage: {sorted(gpu_files - files)}"
    assert all(s["kind"] in ("test", "bench", "e2e") for s in FULL_PLAN)
    assert [s["name"] for s in plan()] == [
        n for n, s in zip(names, FULL_PLAN) if s["kind"] != "e2e"
    ]


def test_every_gpu_marked_test_is_in_a_test_stage():
    """A GPU test in a file the plan does not name never runs on a lent GPU (quant_gemm's sat
    in tests/test_quant_gemm_kernel.py beside its emulated tests, outside every stage)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*cmd, "-m", "gpu", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    marked = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    planned = {f for s in FULL_PLAN if s["kind"] == "test" for f in s["args"].split()}
    assert marked, proc.stdout[-2000:]
    assert marked <= planned, f"GPU tests outside the plan: {sorted(marked - planned)}"


def kernel_benchmarks_outside(stages: list[dict]) -> list[str]:
    """The bench suites with a test taking bench/conftest.py's `device` fixture ("cuda" on a
    GPU: a kernel benchmark) that no bench stage names; the other suites are the host's (CPU
    engine, serving, llama.cpp; they skip on a GPU machine or time host-side work)."""
    planned = {f for s in stages if s["kind"] != "test" for f in s["args"].split()}
    suites = []
    for path in sorted((ROOT / "bench").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if any(
            isinstance(node, ast.FunctionDef)
            and node.name.startswith("test_")
            and "device" in [a.arg for a in node.args.args]
            for node in ast.walk(tree)
        ):
            suites.append(f"bench/{path.name}")
    assert suites, "no bench suite takes the device fixture: the check looks at nothing"
    return [f for f in suites if f not in planned]


def test_every_kernel_benchmark_is_in_a_bench_stage():
    assert not kernel_benchmarks_outside(FULL_PLAN), "kernel benchmarks in no bench stage"
    # The check sees a suite left out of the plan.
    bench = next(s for s in FULL_PLAN if s["kind"] == "bench")
    dropped = bench["args"].split()[0]
    trimmed = {**bench, "args": " ".join(bench["args"].split()[1:])}
    fewer = [trimmed if s is bench else s for s in FULL_PLAN]
    assert kernel_benchmarks_outside(fewer) == [dropped]


def test_every_stage_collects_as_on_the_gpu_machine():
    """Every file of every stage, collected in one process (one interpreter start instead of
    one per stage; a module that fails to import fails the collection all the same)."""
    files = [a for s in FULL_PLAN for a in s["args"].split() if a.endswith(".py")]
    proc = collect(files)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "error" not in output.lower(), output[-4000:]
    collected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    empty = [f for f in files if f not in collected]
    assert not empty, f"collected nothing from {empty} (skipped at module level?)\n{output[-3000:]}"


def test_modules_outside_the_plan_skip_instead_of_failing_collection():
    """A GPU user may run `pytest bench` or the HTTP tests: CPU-only suites and modules needing
    the missing packages skip at module level."""
    proc = collect(["bench", "tests/test_http_server.py", "tests/test_http_concurrency.py"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    for module in ("test_bench_serving.py", "test_bench_engine_cpu.py", "http_stack.py"):
        assert any(module in line for line in output.splitlines() if "SKIPPED" in line), output


def test_the_pretended_gpu_refuses_to_run_anything():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pretend_gpu"]
    proc = subprocess.run(
        [*cmd, "tests/test_norm_gpu.py"], cwd=ROOT, env=gpu_image_env(), capture_output=True
    )
    assert proc.returncode != 0
    assert b"pretend_gpu is for --collect-only runs" in proc.stderr + proc.stdout


@pytest.mark.slow  # runs every stage; the script on small plans: the tests below
def test_dry_run_of_the_whole_check(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--e2e", str(out)],
        capture_output=True,
        text=True,
        env=gpu_image_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= MAX_RESULT_FILES and {"run.log", "junit.xml", "summary.md"} <= set(files)
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["stage"], s["exit"]) for s in summary["stages"]] == [
        (s["name"], "0") for s in FULL_PLAN
    ]
    assert {s["name"] for s in FULL_PLAN if s["kind"] == "test"} <= set(summary["tests"])
    assert summary["bench"]["smoke"] is True
    ops = {r["op"] for r in summary["bench"]["results"]}
    assert {"rms_norm", "silu_and_mul", "paged_attention", "sample", "flash_prefill"} <= ops
    assert "e2e offline" in ops
    text = (out / "summary.md").read_text()
    assert "| stage | kind | result |" in text and "| op | case | impl |" in text
    assert "== summary" in (out / "run.log").read_text()


def test_a_hanging_stage_is_killed_at_its_budget_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_hangs.py").write_text(
        "import threading\n\ndef test_hangs():\n    threading.Event().wait()\n"
    )
    (tmp_path / "test_passes.py").write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    stages = tmp_path / "stages.txt"
    stages.write_text(
        f"# a plan for this test\nhang test 3 60 {tmp_path}/test_hangs.py\n"
        f"after test 60 60 {tmp_path}/test_passes.py\n"
        f"bench bench 60 60 {tmp_path}/test_passes.py\n"
    )
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        env=gpu_image_env(PAGEDKERN_GPU_STAGES=str(stages)),
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    rows = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]
    assert [(r[0], r[2]) for r in rows] == [("hang", "124"), ("after", "0"), ("bench", "skipped")]
    assert "killed at its 3 s budget" in rows[0][4]
    summary = (out / "summary.md").read_text()
    assert "| hang | test | FAILED (exit 124) |" in summary
    assert "test_hangs.py" in (out / "run.log").read_text()


def test_a_hung_test_is_ended_by_pytest_timeout_with_its_stack(tmp_path):
    """Where pytest-timeout is installed (the GPU image has it), the script passes it the plan's
    per-test bound with the thread method, which also ends a test stuck outside Python."""
    pytest.importorskip("pytest_timeout")
    (tmp_path / "test_hangs.py").write_text(
        "import threading\n\ndef test_hangs():\n    threading.Event().wait()\n"
    )
    stages = tmp_path / "stages.txt"
    stages.write_text(f"hang test 60 2 {tmp_path}/test_hangs.py\n")
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        env=gpu_image_env(PAGEDKERN_GPU_STAGES=str(stages)),
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    row = (out / "stages.tsv").read_text().split("\t")
    assert row[0] == "hang" and row[2] == "1" and int(row[3]) < 60  # pytest-timeout, not timeout
    log = (out / "run.log").read_text()
    assert "Timeout" in log and "test_hangs.py" in log and "threading.Event().wait()" in log


def test_a_benchmark_stage_starts_only_with_its_whole_bound_left(tmp_path):
    """A benchmark stage cut short is rerun whole (--stages NAME), so a call that cannot give it
    its bound skips it instead of spending device time on rows measured twice; a later one
    whose bound fits still runs."""
    (tmp_path / "test_passes.py").write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    stages = tmp_path / "stages.txt"
    stages.write_text(
        f"tests test 60 60 {tmp_path}/test_passes.py\n"
        f"long bench 300 60 {tmp_path}/test_passes.py\n"
        f"short bench 30 60 {tmp_path}/test_passes.py\n"
    )
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--budget", "150", str(out)],
        capture_output=True,
        text=True,
        env=gpu_image_env(PAGEDKERN_GPU_STAGES=str(stages)),
        timeout=150,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]  # incomplete: a stage did not run
    rows = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]
    assert [(r[0], r[2]) for r in rows] == [("tests", "0"), ("long", "skipped"), ("short", "0")]
    assert rows[1][4] == "less than its 300 s bound left"
    assert "rerun: --stages long" in (out / "run.log").read_text()
