"""roofline.png for a benchmark report: one bar per timed row, the fraction of its measured
ceiling it reached (GB/s over the device-copy bandwidth for memory-bound ops, TFLOP/s over the
bf16 GEMM rate for flash prefill), pagedkern and its PyTorch references side by side, and a red
mark at the row's target where the suite states one as a fraction of a ceiling (">= 90% of
copy", ">= 550 TFLOP/s"). matplotlib is optional: without it (or without any row that has bytes
or FLOPs and a ceiling) no chart is drawn and the caller is told why."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    fraction: float  # of the ceiling
    ceiling: str
    ours: bool  # a pagedkern row
    target: float | None  # as a fraction of the same ceiling


def target_fraction(target: str, ceilings: dict) -> float | None:
    """ ">= 80% of copy" -> 0.8; ">= 550 TFLOP/s" -> 550 / the measured GEMM rate; else None."""
    if m := re.search(r"(\d+(?:\.\d+)?)% of copy", target):
        return float(m.group(1)) / 100
    if (m := re.search(r"(\d+(?:\.\d+)?) TFLOP/s", target)) and ceilings.get("gemm_tflops"):
        return float(m.group(1)) / ceilings["gemm_tflops"]
    return None


def chart_rows(report) -> list[Bar]:
    """One bar per row with bytes or FLOPs and a measured ceiling, in the report's order."""
    bars = []
    for r in report.results:
        fraction = report.fraction_of_ceiling(r)
        if fraction is not None:
            target = target_fraction(str(r.extra.get("target", "")), report.ceilings)
            label = f"{r.op} | {r.case} | {r.impl}"
            ours = r.impl.startswith("pagedkern")
            bars.append(Bar(label, fraction[0], fraction[1], ours, target))
    return bars


def draw(report, path: Path) -> str:
    """Writes the chart to `path`; returns what was done, in words."""
    rows = chart_rows(report)
    if not rows:
        return "not drawn: no row has a measured ceiling (smoke mode or no benchmark ran)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.28 * len(rows)))
    y = list(range(len(rows)))[::-1]
    ax.barh(
        y,
        [100 * b.fraction for b in rows],
        color=["tab:orange" if b.ours else "tab:gray" for b in rows],
        height=0.7,
    )
    ax.set_yticks(y, [b.label for b in rows], fontsize=7)
    for yi, b in zip(y, rows, strict=True):
        ax.text(
            100 * b.fraction + 1,
            yi,
            f"{100 * b.fraction:.0f}% of {b.ceiling}",
            va="center",
            fontsize=6,
        )
        if b.target is not None:
            ax.plot([100 * b.target] * 2, [yi - 0.4, yi + 0.4], color="tab:red", linewidth=1.5)
    ax.axvline(100, color="black", linewidth=0.8)
    ax.set_xlabel("% of the ceiling measured in this run (device copy GB/s or bf16 GEMM TFLOP/s)")
    ax.set_title("pagedkern vs PyTorch: fraction of the measured roofline (red: target)")
    ax.set_xlim(0, max(110, 100 * max(b.fraction for b in rows) + 15))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"{path.name} ({len(rows)} rows)"
