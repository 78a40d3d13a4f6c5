"""Fixtures for the benchmark suites: the device, the ceilings measured in this run, and
`measure`, which times one implementation of one case and files it in the side-by-side table
printed at the end (and written as JSON to $PAGEDKERN_BENCH_JSON when set).

BENCH_ENV declares the environment variables only the benchmarks read (measure.py reads them;
the package's run-time ones are in pagedkern/envs.py, the build's in setup.py, the tests' in
tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch
from measure import (
    JSON_ENV,
    Report,
    Result,
    measure_copy_bandwidth,
    measure_gemm_rate,
    run_case,
    smoke_mode,
)

BENCH_ENV = {
    "PAGEDKERN_BENCH_SMOKE": "1 forces smoke mode (tiny CPU inputs, numbers meaningless), 0 "
    "forbids it; unset: smoke mode without a GPU.",
    "PAGEDKERN_BENCH_GPU_PATHS": "1 takes the suites' GPU-only branches on a CPU, under the "
    "stubbed extension of tools/rehearsal/gpu_paths.py (with PAGEDKERN_BENCH_SMOKE=1).",
    "PAGEDKERN_BENCH_JSON": "also write the results table as JSON to this path.",
    "PAGEDKERN_BENCH_COMPILE": "1 adds the torch.compile baseline rows (minutes of cold inductor "
    "builds; tools/gpu_check.sh --compile sets it).",
    "PAGEDKERN_BENCH_CPU": "1: the CPU benchmarks at full size on a machine without a GPU "
    "(bench/test_bench_cpu_attention.py, bench/test_bench_cpu_vs_llamacpp.py).",
    "PAGEDKERN_BENCH_GGUF": "bench/test_bench_cpu_vs_llamacpp.py: the GGUF both engines run "
    "(default: the default model's).",
    "PAGEDKERN_BENCH_THREADS": "bench/test_bench_cpu_vs_llamacpp.py: threads for both engines "
    "(default: all CPUs).",
    "PAGEDKERN_BENCH_ROUNDS": "bench/test_bench_cpu_vs_llamacpp.py: interleaved rounds "
    "(default 2).",
    "PAGEDKERN_BENCH_PREFILLS": "bench/test_bench_cpu_vs_llamacpp.py: prefill lengths "
    "(default 512,2048,4000).",
    "PAGEDKERN_BENCH_BACKENDS": "bench/test_bench_cpu_vs_llamacpp.py: pagedkern backends "
    "(default cpu,reference).",
    "PAGEDKERN_BENCH_DEPTHS": "bench/test_bench_cpu_vs_llamacpp.py: prompt lengths before a "
    "timed decode (default 4000; llama-bench's tg @ d).",
    "PAGEDKERN_BENCH_KV_CACHE_DTYPE": "bench/test_bench_cpu_vs_llamacpp.py: pagedkern's KV cache "
    "dtype (default auto: float16 on the CPU, llama.cpp's f16 bytes).",
    "PAGEDKERN_BENCH_CACHE": "bench/random_gguf.py: where the random-weight Q4_0 GGUFs are "
    "built and kept (default: <pagedkern's cache>/bench).",
    "PAGEDKERN_BENCH_PROFILE": "bench/test_bench_http_frontend.py: a folder; the HTTP front end "
    "runs under a sampling profiler, writes its counts there and the bench prints CPU µs per "
    "token per component.",
}

_REPORT = Report()


@pytest.fixture(scope="session")
def device() -> str:
    return "cpu" if smoke_mode() else "cuda"


@pytest.fixture(scope="session")
def smoke() -> bool:
    return smoke_mode()


@pytest.fixture(scope="session")
def copy_gbps() -> float:
    if "copy_gbps" not in _REPORT.ceilings:
        _REPORT.ceilings["copy_gbps"] = measure_copy_bandwidth()
    return _REPORT.ceilings["copy_gbps"]


@pytest.fixture(scope="session")
def gemm_tflops() -> float:
    if "gemm_tflops" not in _REPORT.ceilings:
        _REPORT.ceilings["gemm_tflops"] = measure_gemm_rate()
    return _REPORT.ceilings["gemm_tflops"]


@pytest.fixture
def measure(benchmark, copy_gbps):
    """measure(op, case, impl, fn, bytes=..., flops=..., baseline=...) -> Result; fn is called
    repeatedly; baseline names the PyTorch row it is compared with (default torch eager)."""

    def run(op, case, impl, fn, *, bytes=None, flops=None, baseline=None, **extra) -> Result:
        seconds = run_case(benchmark, fn)
        result = Result(op, case, impl, seconds, bytes, flops, extra, baseline)
        benchmark.extra_info.update(
            op=op, case=case, impl=impl, gbps=result.gbps, tflops=result.tflops, seconds=seconds
        )
        _add(result)
        return result

    return run


@pytest.fixture
def record():
    """record(op, case, impl, seconds, **notes): file a case timed by the test itself (e.g. an
    end-to-end run measured with the wall clock)."""

    def add(op, case, impl, seconds, *, bytes=None, flops=None, baseline=None, **extra) -> Result:
        result = Result(op, case, impl, seconds, bytes, flops, extra, baseline)
        _add(result)
        return result

    return add


def _add(result: Result) -> None:
    """Files a row, and writes the JSON at once: a stage killed at its bound keeps its rows."""
    _REPORT.add(result)
    path = os.environ.get(JSON_ENV)
    if path:
        _REPORT.write_json(path)


def pytest_terminal_summary(terminalreporter):
    if not _REPORT.results:
        return
    terminalreporter.section("pagedkern benchmarks")
    terminalreporter.write_line(_REPORT.table())
    path = os.environ.get(JSON_ENV)
    if path:
        _REPORT.write_json(path)
        terminalreporter.write_line(f"written: {path}")


def pytest_report_header(config):
    where = "smoke mode (CPU, tiny sizes)" if smoke_mode() else torch.cuda.get_device_name()
    return f"pagedkern benchmarks: {where}"


@pytest.fixture
def kernels(monkeypatch):
    """`kernels(sample="v3")` selects kernel variants (PAGEDKERN_KERNELS, ops/variants.py) on top
    of those already selected, until the test ends."""
    from pagedkern.ops.variants import ENV_NAME, kernels_value

    def select(**chosen: str) -> None:
        monkeypatch.setenv(ENV_NAME, kernels_value(**chosen))

    return select
