"""The project's own tools stay runnable: tools/gpu_check.sh in dry-run mode (CPU, smoke
benchmarks) produces its summary, and the code is ruff-clean."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_a_summary(tmp_path):
    out = tmp_path / "results"
    env = {"PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", "--e2e", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bench"]["smoke"] is True
    ops = {r["op"] for r in summary["bench"]["results"]}
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "e2e offline"} <= ops
    assert "| op | case | impl |" in (out / "summary.md").read_text()


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


def _readme_block(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in _readme_block("Set up") + _readme_block("Test"):
        assert line in ci, f"README command not in .ci/run: {line}"
