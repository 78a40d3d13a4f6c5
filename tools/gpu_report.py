"""The summary of a tools/gpu_check.sh results folder: summary.md (for people), summary.json and,
where matplotlib imports, roofline.png, from what the stages left there: stages.tsv (each
stage's exit status and time), junit.xml (every pytest stage) and bench.json (benchmark rows).
Any of them may be missing (a killed run): the summary says so instead of failing.

  python tools/gpu_report.py RESULTS_DIR
  python tools/gpu_report.py --merge-junit STAGE.xml RESULTS_DIR/junit.xml
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))

MAX_LISTED = 40  # failures listed in summary.md (all are in junit.xml)


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


def merge_junit(stage_xml: Path, merged: Path) -> None:
    """Appends one stage's <testsuite> elements to the run's junit.xml (created if absent)."""
    suites = ET.parse(stage_xml).getroot()
    root = ET.parse(merged).getroot() if merged.is_file() else ET.Element("testsuites")
    for suite in [suites] if suites.tag == "testsuite" else suites.findall("testsuite"):
        root.append(suite)
    ET.ElementTree(root).write(merged, encoding="utf-8", xml_declaration=True)


def read_stages(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    keys = ("stage", "kind", "exit", "seconds", "note")
    lines = path.read_text().splitlines()
    return [dict(zip(keys, line.split("\t"), strict=False)) for line in lines]


def read_tests(path: Path) -> dict[str, dict]:
    """Per pytest stage (JUnit suite name): counts and the failed tests with their messages."""
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = {}
    for suite in suites:
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = []
        for case in suite.iter("testcase"):
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                message = (problem.get("message") or "").strip().splitlines()
                name = f"{case.get('classname')}::{case.get('name')}"
                failed.append(f"{name}: {message[0][:200] if message else problem.tag}")
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"]
        counts["passed"] -= counts["skipped"]
        tests[suite.get("name", "pytest")] = {**counts, "failed": failed}
    return tests


def _stage_lines(stages: list[dict], tests: dict[str, dict]) -> list[str]:
    lines = ["| stage | kind | result | seconds | tests passed / failed / skipped | note |"]
    lines.append("|---|---|---|---:|---|---|")
    for s in stages:
        result = {"0": "ok", "skipped": "not run"}.get(s["exit"], f"FAILED (exit {s['exit']})")
        t = tests.get(s["stage"])
        counts = f"{t['passed']} / {t['failures'] + t['errors']} / {t['skipped']}" if t else ""
        cells = (s["stage"], s["kind"], result, s["seconds"], counts, s.get("note", ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(out: Path) -> int:
    from measure import Report

    stages = read_stages(out / "stages.tsv")
    tests = read_tests(out / "junit.xml")
    summary = {"commit": _commit(), "machine": _machine(), "stages": stages, "tests": tests}
    lines = [f"# pagedkern gpu_check — commit {summary['commit']}", ""]
    lines.append("machine: " + ", ".join(f"{k} {v}" for k, v in summary["machine"].items()))
    lines += ["", *(_stage_lines(stages, tests) if stages else ["stages: no stages.tsv"])]
    failed = [f for t in tests.values() for f in t["failed"]]
    if failed:
        lines += ["", f"{len(failed)} failed:"]
        lines += [f"  - {f}" for f in failed[:MAX_LISTED]]
        if len(failed) > MAX_LISTED:
            lines.append(f"  - ... {len(failed) - MAX_LISTED} more in junit.xml")
    bench = out / "bench.json"
    if bench.is_file():
        report = Report.read_json(str(bench))
        summary["bench"] = report.to_json()
        lines += ["", report.table()]
    else:
        report = None
        lines += ["", "benchmarks: no bench.json (not run, or killed before the end)"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")  # before the chart: it may be slow
    if report is not None:
        from roofline_chart import draw

        lines += ["", f"chart: {draw(report, out / 'roofline.png')}"]
        (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--merge-junit":
        merge_junit(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
