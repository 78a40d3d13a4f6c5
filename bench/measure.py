"""Timing and the results table shared by every benchmark suite.

On a GPU, a case is timed with CUDA events around `inner` back-to-back calls (after warm-up),
repeated in pytest-benchmark rounds; the median per-call time gives GB/s or TFLOP/s, reported
beside the ceiling measured in the same run (device copy bandwidth, bf16 GEMM rate). In smoke
mode (no GPU, or PAGEDKERN_BENCH_SMOKE=1) every case runs once on tiny CPU inputs so a broken
benchmark is caught in CI before a GPU is spent on it; its numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

import pagedkern


def smoke_mode() -> bool:
    """PAGEDKERN_BENCH_SMOKE=1 forces smoke mode, =0 forbids it; unset: smoke without a GPU."""
    setting = os.environ.get("PAGEDKERN_BENCH_SMOKE")
    if setting in ("0", "1"):
        return setting == "1"
    return not (pagedkern.cuda_available() and torch.cuda.is_available())


def compile_reference(fn: Callable) -> Callable:
    """torch.compile of a reference op; in smoke mode with the eager backend (tracing checked,
    no code generation: inductor costs ~20 s per op on a 2-core CPU)."""
    return torch.compile(fn, backend="eager" if smoke_mode() else "inductor", dynamic=False)


@dataclass(slots=True)
class Result:
    op: str
    case: str
    impl: str
    seconds: float
    bytes: float | None = None
    flops: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.bytes else None

    @property
    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.flops else None


def time_cuda(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call over `inner` back-to-back calls, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def run_case(benchmark, fn: Callable[[], object], rounds: int = 15, inner: int = 20) -> float:
    """Median seconds per call of fn, timed under pytest-benchmark."""
    if smoke_mode():
        t0 = time.perf_counter()
        benchmark.pedantic(fn, rounds=1, iterations=1)
        return time.perf_counter() - t0
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples: list[float] = []
    benchmark.pedantic(lambda: samples.append(time_cuda(fn, inner)), rounds=rounds, iterations=1)
    return statistics.median(samples)


def measure_copy_bandwidth() -> float:
    """Device copy bandwidth in GB/s (bytes read + written), the memory-bound ceiling."""
    if smoke_mode():
        return 1.0
    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")  # 512 MiB, far above L2
    dst = torch.empty_like(src)
    seconds = min(time_cuda(lambda: dst.copy_(src), 10) for _ in range(5))
    return 2 * src.numel() / seconds / 1e9


def measure_gemm_rate() -> float:
    """Dense bf16 GEMM rate in TFLOP/s (8192^3 matmul), the compute-bound ceiling."""
    if smoke_mode():
        return 1.0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    seconds = min(time_cuda(lambda: a @ b, 5) for _ in range(3))
    return 2 * 8192**3 / seconds / 1e12


class Report:
    """Collects every case of the run and renders one side-by-side table per op."""

    def __init__(self) -> None:
        self.results: list[Result] = []
        self.ceilings: dict[str, float] = {}
        self.smoke = smoke_mode()

    def add(self, result: Result) -> None:
        self.results.append(result)

    def table(self) -> str:
        copy, gemm = self.ceilings.get("copy_gbps"), self.ceilings.get("gemm_tflops")

        def ceiling(value, unit):
            return f"{value:.0f} {unit}" if value else "not measured"

        lines = [
            f"ceilings: device copy {ceiling(copy, 'GB/s')}, bf16 GEMM {ceiling(gemm, 'TFLOP/s')}"
            + (" -- SMOKE MODE (CPU, tiny sizes): the numbers mean nothing" if self.smoke else ""),
            "",
            "| op | case | impl | time (us) | GB/s | % copy | TFLOP/s | % GEMM | vs eager "
            "| notes |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        eager = {(r.op, r.case): r.seconds for r in self.results if r.impl == "torch eager"}
        for r in self.results:
            base = eager.get((r.op, r.case))
            cells = [
                r.op,
                r.case,
                r.impl,
                f"{r.seconds * 1e6:.1f}",
                f"{r.gbps:.0f}" if r.gbps else "",
                f"{100 * r.gbps / copy:.0f}%" if r.gbps and copy else "",
                f"{r.tflops:.1f}" if r.tflops else "",
                f"{100 * r.tflops / gemm:.0f}%" if r.tflops and gemm else "",
                f"{base / r.seconds:.2f}x" if base else "",
                ", ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in r.extra.items()
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        rows = []
        for r in self.results:
            row = asdict(r)
            row.update(gbps=r.gbps, tflops=r.tflops)
            rows.append(row)
        return {"smoke": self.smoke, "ceilings": self.ceilings, "results": rows}

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def read_json(cls, path: str) -> Report:
        with open(path) as f:
            data = json.load(f)
        report = cls()
        report.ceilings = data["ceilings"]
        report.smoke = data["smoke"]
        fields = ("op", "case", "impl", "seconds", "bytes", "flops", "extra")
        report.results = [Result(**{k: row[k] for k in fields}) for row in data["results"]]
        return report
