"""Fixtures for the benchmark suites: the device, the ceilings measured in this run, and
`measure`, which times one implementation of one case and files it in the side-by-side table
printed at the end (and written as JSON to $PAGEDKERN_BENCH_JSON when set)."""

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
        _REPORT.add(result)
        return result

    return run


@pytest.fixture
def record():
    """record(op, case, impl, seconds, **notes): file a case timed by the test itself (e.g. an
    end-to-end run measured with the wall clock)."""

    def add(op, case, impl, seconds, *, bytes=None, flops=None, baseline=None, **extra) -> Result:
        result = Result(op, case, impl, seconds, bytes, flops, extra, baseline)
        _REPORT.add(result)
        return result

    return add


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
