"""The CPU GEMM's Arm path (csrc/cpu/dot_neon.cpp, `neon_dotprod`) without Arm hardware:
tests/cpu_gemv_neon_check.cpp and csrc/cpu/ (minus the pybind module) cross-compiled for baseline
aarch64 and run under qemu-aarch64. With a dotprod CPU (`-cpu max`) the path runs and returns the
portable path's bits for int4 (G 32, 128), int4_sym, int4_k and int8 tiles, 8- and 16-bit
activations, M 1/3/5/17 and N 40/1000 (a partial last tile); on a CPU without dotprod
(`-cpu cortex-a53`) it is reported unsupported, refused with an error rather than SIGILL, and
best_path is portable.
Skipped where the cross compiler or qemu-user is missing (Debian: g++-aarch64-linux-gnu,
qemu-user). Also: the Python side's path names and codes are the module's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pagedkern.ops import variants
from pagedkern.ops.cpu import quant_gemv

ROOT = Path(__file__).resolve().parents[1]
CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


@pytest.fixture(scope="module")
def aarch64_check(tmp_path_factory) -> Path:
    missing = [tool for tool in (CXX, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not found: the aarch64 check needs a cross compiler and "
            "qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user)"
        )
    binary = tmp_path_factory.mktemp("neon") / "cpu_gemv_neon_check"
    sources = [
        str(p)
        for p in sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))
        if not p.name.startswith("module")
    ]
    base = [CXX, "-O3", "-std=c++17", "-ffp-contract=off", "-static", "-o", str(binary)]
    base += [str(ROOT / "tests" / "cpu_gemv_neon_check.cpp"), *sources]
    # with the cross libgomp where it is installed (threads split N), else one thread
    for flags in (["-fopenmp"], []):
        built = subprocess.run(base + flags, capture_output=True, text=True, timeout=240)
        if built.returncode == 0:
            return binary
    pytest.fail(f"the aarch64 build failed:\n{built.stderr[-4000:]}")


@pytest.mark.parametrize(
    "cpu,mode", [("max", "dotprod"), ("cortex-a76", "dotprod"), ("cortex-a53", "no-dotprod")]
)
def test_neon_dotprod_under_qemu(aarch64_check, cpu, mode):
    run = subprocess.run(
        [QEMU, "-cpu", cpu, str(aarch64_check), mode], capture_output=True, text=True, timeout=120
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]  # a SIGILL would be -4
    assert "ok (" in out
    assert f"best path: {'neon_dotprod' if mode == 'dotprod' else 'portable'}" in out


def test_python_paths_are_the_modules():
    if not quant_gemv.available():
        pytest.skip(quant_gemv.unavailable_reason())
    codes = quant_gemv.cpu_module().PATHS
    assert list(quant_gemv.PATHS) == sorted(codes, key=codes.get)
    isa = {v.name: v.code for v in variants.VARIANTS["cpu_gemv_isa"].variants if v.name != "auto"}
    assert isa == dict(codes)
