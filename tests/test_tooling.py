"""The project's own tools: the benchmark table compares each row with its PyTorch baseline and
its measured ceiling, tools/gpu_report.py summarises what a (maybe killed) GPU check left, the
roofline chart reads its targets right, and the code is ruff-clean. The GPU check itself is
rehearsed end to end in test_gpu_check_rehearsal.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report(smoke: bool = False):
    from measure import Report, Result

    report = Report()
    report.smoke = smoke
    report.ceilings = {"copy_gbps": 4000.0, "gemm_tflops": 800.0}
    report.results = [
        Result(
            "sample",
            "B=128",
            "pagedkern",
            1e-4,
            bytes=2e8,
            extra={"target": ">= 5x"},
            baseline="torch sort top-p",
        ),
        Result("sample", "B=128", "torch sort top-p", 5e-4, bytes=2e8, baseline="torch sort top-p"),
        Result("sample", "B=128", "torch eager", 8e-4, bytes=2e8, baseline="torch sort top-p"),
        Result(
            "rms_norm",
            "8192x4096",
            "pagedkern",
            2e-5,
            bytes=72e6,
            extra={"target": ">= 90% of copy"},
        ),
        Result("rms_norm", "8192x4096", "torch eager", 6e-5, bytes=72e6),
        Result(
            "flash_prefill",
            "1x16384",
            "pagedkern path 2",
            1e-3,
            flops=5e11,
            extra={"target": ">= 550 TFLOP/s and > sdpa cudnn"},
            baseline="torch sdpa cudnn",
        ),
        Result("flash_prefill", "1x16384", "torch sdpa cudnn", 1.25e-3, flops=5e11),
    ]
    return report


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT / "tools"))


def test_each_row_is_compared_with_its_named_pytorch_baseline(bench_path):
    lines = _report().table().splitlines()[4:]
    rows = {tuple(line.split(" | ")[i] for i in (0, 2)): line for line in lines}
    assert "| 5.00x torch sort top-p |" in rows["| sample", "pagedkern"]
    assert "| 0.62x torch sort top-p |" in rows["| sample", "torch eager"]
    assert "| 3.00x torch eager |" in rows["| rms_norm", "pagedkern"]
    assert "| 90% |" in rows["| rms_norm", "pagedkern"]  # 3600 of 4000 GB/s
    assert "| 1.25x torch sdpa cudnn |" in rows["| flash_prefill", "pagedkern path 2"]
    assert "| 62% |" in rows["| flash_prefill", "pagedkern path 2"]  # 500 of 800 TFLOP/s
    assert "x torch" not in rows["| sample", "torch sort top-p"]  # not compared with itself


def test_report_json_keeps_earlier_stages_rows(bench_path, tmp_path):
    from measure import Report

    path = tmp_path / "bench.json"
    first, second = _report(), _report()
    second.results = second.results[:2]
    second.ceilings = {"copy_gbps": 4100.0}
    first.write_json(str(path))
    second.write_json(str(path))
    merged = Report.read_json(str(path))
    assert len(merged.results) == 9 and merged.results[0].baseline == "torch sort top-p"
    assert merged.ceilings == {"copy_gbps": 4100.0, "gemm_tflops": 800.0}


def test_report_json_written_after_each_row_holds_each_row_once(bench_path, tmp_path):
    """bench/conftest.py writes the file after every row (a stage killed at its bound keeps
    what it finished): rewriting never repeats this run's rows nor drops an earlier stage's."""
    from measure import Report

    path = tmp_path / "bench.json"
    earlier, run = _report(), Report()
    earlier.results = earlier.results[:3]
    earlier.write_json(str(path))
    for row in _report().results:
        run.add(row)
        run.write_json(str(path))
        assert len(Report.read_json(str(path)).results) == 3 + len(run.results)
    assert not (tmp_path / "bench.json.partial").exists()
    rows = Report.read_json(str(path)).results
    assert [r.case for r in rows] == [r.case for r in earlier.results + run.results]


def test_chart_targets_are_fractions_of_the_named_ceiling(bench_path):
    from roofline_chart import chart_rows, target_fraction

    assert target_fraction(">= 90% of copy", {}) == 0.9
    assert target_fraction(">= 550 TFLOP/s and > sdpa cudnn", {"gemm_tflops": 800.0}) == 550 / 800
    assert target_fraction(">= 5x torch sort top-p", {"gemm_tflops": 800.0}) is None
    bars = {b.label: b for b in chart_rows(_report())}
    assert bars["rms_norm | 8192x4096 | pagedkern"].fraction == pytest.approx(72e6 / 2e-5 / 4e12)
    assert bars["rms_norm | 8192x4096 | pagedkern"].target == 0.9
    assert bars["flash_prefill | 1x16384 | pagedkern path 2"].ceiling == "bf16 GEMM"


def test_chart_is_drawn_with_matplotlib(bench_path, tmp_path):
    pytest.importorskip("matplotlib")  # on the GPU image; not a CI dependency
    from roofline_chart import draw

    assert draw(_report(), tmp_path / "roofline.png").startswith("roofline.png (7 rows)")
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_of_a_killed_run(bench_path, tmp_path):
    """Only what the stages left: one finished stage, its JUnit suite, no bench.json."""
    import gpu_report

    stage_xml = tmp_path / "stage.xml"
    stage_xml.write_text(
        '<testsuites><testsuite name="flash-prefill" tests="3" failures="1" errors="0" '
        'skipped="1"><testcase classname="t" name="ok"/><testcase classname="t" name="bad">'
        '<failure message="relative error 0.5 &gt; 0.01&#10;more">tb</failure></testcase>'
        '<testcase classname="t" name="s"><skipped/></testcase></testsuite></testsuites>'
    )
    gpu_report.merge_junit(stage_xml, tmp_path / "junit.xml")
    (tmp_path / "stages.tsv").write_text(
        "flash-prefill\ttest\t124\t150\tkilled at its 150 s budget\n"
    )
    assert gpu_report.main(tmp_path) == 0
    text = (tmp_path / "summary.md").read_text()
    assert (
        "| flash-prefill | test | FAILED (exit 124) | 150 | 1 / 1 / 1 | killed at its 150 s" in text
    )
    assert "t::bad: relative error 0.5 > 0.01" in text
    assert "benchmarks: no bench.json" in text
    assert (
        json.loads((tmp_path / "summary.json").read_text())["tests"]["flash-prefill"]["passed"] == 1
    )


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff not installed",
)
def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    paths = [str(ROOT / p) for p in ("python", "tests", "bench", "tools", "setup.py")]
    lint = subprocess.run([ruff, "check", *paths], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    fmt = subprocess.run([ruff, "format", "--check", *paths], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout


LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"


def test_imports_follow_the_layer_rules():
    """.importlinter: each layer imports only from those below it, and engine and model reach
    kernels and references only through ops (the listed exceptions aside)."""
    pytest.importorskip("importlinter")
    lint = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, str(ROOT / ".importlinter"), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=ROOT / "python",
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "0 broken" in lint.stdout


def _readme_block(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in _readme_block("Set up") + _readme_block("Test"):
        assert line in ci, f"README command not in .ci/run: {line}"


def test_each_timed_call_follows_an_l2_flush(bench_path, monkeypatch):
    """time_cuda's order of work on the stream, with CUDA events and the flush replaced by
    recorders: flush, start event, the call, end event, for every call; median per call."""
    import measure

    log: list[str] = []
    clock = iter(range(1000))

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.t = None

        def record(self) -> None:
            self.t = next(clock)
            log.append("event")

        def synchronize(self) -> None:
            log.append("sync")

        def elapsed_time(self, end) -> float:  # ms: the starts are recorded at t = 0, 2, 4
            assert end.t == self.t + 1
            return float(self.t + 1)

    monkeypatch.setattr(measure.torch.cuda, "Event", Event)
    monkeypatch.setattr(measure, "flush_l2", lambda: log.append("flush"))
    seconds = measure.time_cuda(lambda: log.append("fn"), inner=3)
    assert log == ["flush", "event", "fn", "event"] * 3 + ["sync"]
    assert seconds == pytest.approx(3e-3)  # per-call 1, 3, 5 ms (start t = 0, 2, 4): median 3
    log.clear()
    measure.time_cuda(lambda: log.append("fn"), inner=3, flush=False)
    assert log == ["event", "fn", "fn", "fn", "event", "sync"]
