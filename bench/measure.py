"""Timing and the results table shared by every benchmark suite.

On a GPU, a case is timed with CUDA events around each of `inner` calls, with L2 flushed before
each one (a read of twice the L2's size), repeated in pytest-benchmark rounds; the median
per-call time gives GB/s or TFLOP/s, reported beside the ceiling measured in the same run
(device copy bandwidth, bf16 GEMM rate) and beside the PyTorch row the case is compared with
(its baseline: torch eager unless the suite names another, e.g. the sort-based top-p sampler).
Without the flush, a case smaller than L2 (60 MB on an H200) would be timed from L2, not HBM.
In smoke mode (no GPU, or PAGEDKERN_BENCH_SMOKE=1) every case runs once on tiny CPU inputs so a
broken benchmark is caught in CI before a GPU is spent on it; its numbers mean nothing.
torch.compile rows run only with PAGEDKERN_BENCH_COMPILE=1 (gpu_check.sh --compile): each is a
cold inductor build of minutes, and no target is set against them; smoke mode traces them
with the eager backend so the code path stays checked.
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

SMOKE_ENV = "PAGEDKERN_BENCH_SMOKE"
COMPILE_ENV = "PAGEDKERN_BENCH_COMPILE"
JSON_ENV = "PAGEDKERN_BENCH_JSON"  # where conftest writes the table as JSON
GPU_PATHS_ENV = "PAGEDKERN_BENCH_GPU_PATHS"  # gpu_paths() on the CPU
DEFAULT_BASELINE = "torch eager"


def smoke_mode() -> bool:
    """PAGEDKERN_BENCH_SMOKE=1 forces smoke mode, =0 forbids it; unset: smoke without a GPU."""
    setting = os.environ.get(SMOKE_ENV)
    if setting in ("0", "1"):
        return setting == "1"
    return not (pagedkern.cuda_available() and torch.cuda.is_available())


def gpu_paths() -> bool:
    """Whether a suite takes its GPU-only branches (device queries, workspaces sized by the
    extension): on a GPU, and in the CPU rehearsal of those branches (PAGEDKERN_BENCH_GPU_PATHS=1
    with smoke sizes, the device pretended and the extension stubbed with its real signatures:
    tools/rehearsal/gpu_paths.py), so a broken call there fails in CI, not on a lent GPU."""
    return not smoke_mode() or os.environ.get(GPU_PATHS_ENV) == "1"


def compile_enabled() -> bool:
    """torch.compile rows: PAGEDKERN_BENCH_COMPILE=1, or smoke mode (eager backend, cheap)."""
    return os.environ.get(COMPILE_ENV) == "1" or smoke_mode()


def with_compile(impls: list[str]) -> list[str]:
    """The suite's implementations, less the torch.compile ones unless they are enabled."""
    return [i for i in impls if compile_enabled() or not i.startswith("torch.compile")]


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
    baseline: str | None = None  # impl of the row this one is compared with (default: eager)

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.bytes else None

    @property
    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.flops else None


class L2Flush:
    """Evicts L2 by reading a buffer twice its size. A read, not a memset (llm.c, Triton's
    do_bench): a memset leaves L2 full of dirty lines whose write-back would then be charged to
    the timed kernel; after a read, the lines are clean and leave for free."""

    def __init__(self) -> None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2 = getattr(props, "L2_cache_size", 0) or 128 << 20  # (older torch: assume 128 MiB)
        self.buffer = torch.ones(max(2 * l2, 1 << 20) // 4, dtype=torch.float32, device="cuda")

    def __call__(self) -> None:
        self.buffer.sum()


_flush: L2Flush | None = None


def flush_l2() -> None:
    global _flush
    if _flush is None:
        _flush = L2Flush()
    _flush()


def time_cuda(fn: Callable[[], object], inner: int, flush: bool = True) -> float:
    """Seconds per call by CUDA events: with flush, the median of `inner` calls timed one by one,
    each after an L2 flush (so inputs come from HBM); without, the mean of `inner` back-to-back
    calls (for cases far larger than L2, e.g. the ceilings)."""
    if not flush:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(inner)
    ]
    for start, end in events:
        flush_l2()
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def per_call_seconds(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Host seconds per call (no GPU involved): the median over rounds of `calls` calls."""
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def best_host_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Host microseconds per call (no GPU involved): after one warm-up call, the best over
    rounds of `calls` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def host_copy_bandwidth(nbytes: int, rounds: int = 3) -> float:
    """This host's copy bandwidth in GB/s (bytes read + written) over `nbytes`: the ceiling a
    CPU GEMV approaches."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_host_us(lambda: dst.copy_(src), 5, rounds) / 1e3


def run_case(benchmark, fn: Callable[[], object], rounds: int = 15, inner: int = 20) -> float:
    """Median seconds per call of fn (L2 flushed before each call), timed under pytest-benchmark."""
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
    seconds = min(time_cuda(lambda: dst.copy_(src), 10, flush=False) for _ in range(5))
    return 2 * src.numel() / seconds / 1e9


def measure_gemm_rate() -> float:
    """Dense bf16 GEMM rate in TFLOP/s (8192^3 matmul), the compute-bound ceiling."""
    if smoke_mode():
        return 1.0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    seconds = min(time_cuda(lambda: a @ b, 5, flush=False) for _ in range(3))
    return 2 * 8192**3 / seconds / 1e12


class Report:
    """Collects every case of the run and renders one side-by-side table per op."""

    def __init__(self) -> None:
        self.results: list[Result] = []
        self.ceilings: dict[str, float] = {}
        self.smoke = smoke_mode()
        self._earlier: dict | None = None  # the file's rows before this run's first write

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
            "| op | case | impl | time (us) | GB/s | % copy | TFLOP/s | % GEMM | speed-up vs "
            "| notes |",
            "|---|---|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in self.results:
            base = self.baseline_of(r)
            cells = [
                r.op,
                r.case,
                r.impl,
                f"{r.seconds * 1e6:.1f}",
                f"{r.gbps:.0f}" if r.gbps else "",
                f"{100 * r.gbps / copy:.0f}%" if r.gbps and copy else "",
                f"{r.tflops:.1f}" if r.tflops else "",
                f"{100 * r.tflops / gemm:.0f}%" if r.tflops and gemm else "",
                f"{base.seconds / r.seconds:.2f}x {base.impl}" if base else "",
                ", ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in r.extra.items()
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def baseline_of(self, result: Result) -> Result | None:
        """The PyTorch row of the same op and case that `result` is compared with, if timed."""
        impl = result.baseline or DEFAULT_BASELINE
        if impl == result.impl:
            return None
        for r in self.results:
            if (r.op, r.case, r.impl) == (result.op, result.case, impl):
                return r
        return None

    def fraction_of_ceiling(self, result: Result) -> tuple[float, str] | None:
        """(achieved / measured ceiling, which ceiling) for a row with bytes or FLOPs."""
        copy, gemm = self.ceilings.get("copy_gbps"), self.ceilings.get("gemm_tflops")
        if result.tflops and gemm:
            return result.tflops / gemm, "bf16 GEMM"
        if result.gbps and copy:
            return result.gbps / copy, "device copy"
        return None

    def to_json(self) -> dict:
        rows = []
        for r in self.results:
            row = asdict(r)
            row.update(gbps=r.gbps, tflops=r.tflops)
            rows.append(row)
        return {"smoke": self.smoke, "ceilings": self.ceilings, "results": rows}

    def write_json(self, path: str) -> None:
        """Writes the run's rows; rows already in the file before this run's first write (an
        earlier stage of the same gpu_check run, e.g. the kernels before the end-to-end
        benchmarks) are kept. Called after every row (bench/conftest.py), so a stage killed
        at its time bound keeps the rows it finished: replaced whole, never half written."""
        if self._earlier is None:
            self._earlier = Report.read_json(path).to_json() if os.path.isfile(path) else {}
        data = self.to_json()
        if self._earlier:
            data["results"] = self._earlier["results"] + data["results"]
            data["ceilings"] = {**self._earlier["ceilings"], **data["ceilings"]}
        partial = f"{path}.partial"
        with open(partial, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(partial, path)

    @classmethod
    def read_json(cls, path: str) -> Report:
        with open(path) as f:
            data = json.load(f)
        report = cls()
        report.ceilings = data["ceilings"]
        report.smoke = data["smoke"]
        fields = ("op", "case", "impl", "seconds", "bytes", "flops", "extra", "baseline")
        report.results = [
            Result(**{k: row[k] for k in fields if k in row}) for row in data["results"]
        ]
        return report
