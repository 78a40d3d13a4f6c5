"""Build and run a host-side layout check (tests/*_layouts.cu: CuTe layouts and hand-written
addresses checked on the very types a kernel uses, no GPU) with nvcc against csrc/ and the
CUTLASS headers of nvidia-cutlass. Without nvcc or the headers the test is skipped, or fails
where the CUDA build is required."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from build_env import cuda_build_required

ROOT = Path(__file__).resolve().parents[2]


def _nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [str(Path(os.environ.get(v, "/nonexistent")) / "bin/nvcc")
                   for v in ("CUDA_HOME", "CUDA_PATH")]  # fmt: skip
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and Path(c).is_file()), None)


def _cutlass_include() -> Path | None:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    return include if (include / "cute" / "tensor.hpp").is_file() else None


def run_layout_check(source: str, tmp_path: Path) -> None:
    """Build tests/`source` into tmp_path, run it, and assert it exits 0 printing "ok"."""
    nvcc, include = _nvcc(), _cutlass_include()
    if nvcc is None or include is None:
        if cuda_build_required():
            pytest.fail("nvcc and the CUTLASS headers are needed for the layout check")
        pytest.skip("needs nvcc and the CUTLASS headers (nvidia-cutlass)")
    exe = tmp_path / Path(source).stem
    cmd = [nvcc, "-std=c++17", "-O1", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}"]
    cmd += ["-isystem", str(include), "-o", str(exe), str(ROOT / "tests" / source)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
