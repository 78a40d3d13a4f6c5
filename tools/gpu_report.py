"""Writes summary.md and summary.json for a tools/gpu_check.sh results folder: machine, commit,
build time, test counts and failures (JUnit XML), and the benchmark table (bench.json)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def _commit() -> str:
    try:
        cmd = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> dict:
    info = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def _tests(path: Path) -> dict:
    if not path.is_file():
        return {"missing": True}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed": failed}


def main(out: Path) -> int:
    from measure import Report

    summary = {"commit": _commit(), "machine": _machine(), "tests": _tests(out / "tests.xml")}
    build = out / "build.env"
    if build.is_file():
        summary["build_seconds"] = int(build.read_text().split("=")[1])
    lines = [f"# pagedkern gpu_check — commit {summary['commit']}", ""]
    lines.append("machine: " + ", ".join(f"{k} {v}" for k, v in summary["machine"].items()))
    if "build_seconds" in summary:
        lines.append(f"build: {summary['build_seconds']} s")
    t = summary["tests"]
    if t.get("missing"):
        lines.append("tests: no result file")
    else:
        passed = t["tests"] - t["failures"] - t["errors"] - t["skipped"]
        lines.append(
            f"gpu tests: {passed} passed, {t['failures'] + t['errors']} failed, "
            f"{t['skipped']} skipped"
        )
        lines += [f"  - FAILED {name}" for name in t["failed"]]
    bench = out / "bench.json"
    if bench.is_file():
        report = Report.read_json(str(bench))
        summary["bench"] = report.to_json()
        lines += ["", report.table()]
    else:
        lines.append("benchmarks: no result file")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
