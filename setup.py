"""Builds pagedkern._C with CMake + Ninja (metadata lives in pyproject.toml).

Environment: the PAGEDKERN_* build variables are defined (name, default, parsing) in
python/pagedkern/envs.py, loaded here by path since the package is not built yet, so setup.py
and the package agree on them: PAGEDKERN_BUILD_CUDA=0 skips the CUDA build; with
PAGEDKERN_REQUIRE_CUDA=1 (or, unset, CI=true) a missing nvcc or a failing build is an error,
otherwise the package installs without _C, with a warning, and runs on the PyTorch reference ops;
PAGEDKERN_CUTLASS_INCLUDE and PAGEDKERN_CUDA_ARCHS. MAX_JOBS: parallel compile jobs (default: all
cores).

The CMake build folder is build/cmake-<python tag> under the project root and persists between
installs, so an unchanged `pip install -e .` recompiles nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load_envs():
    spec = importlib.util.spec_from_file_location(
        "pagedkern_envs", ROOT / "python/pagedkern/envs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


envs = _load_envs()


def _require_cuda() -> bool:
    return envs.cuda_build_required()


def _find_nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def _find_cutlass_include() -> str | None:
    env = envs.ENV["PAGEDKERN_CUTLASS_INCLUDE"].get()
    if env:
        return env
    # find_spec locates the package without importing it (its imports pull heavy dependencies).
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    return str(include) if (include / "cute" / "tensor.hpp").is_file() else None


def _tool(module: str, attr: str, name: str) -> str | None:
    """Path of cmake/ninja: the pip-installed one if present, else the one on PATH."""
    try:
        mod = __import__(module)
        path = Path(getattr(mod, attr)) / name
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which(name)


class CMakeBuild(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure becomes a warning unless required
            if _require_cuda():
                raise
            self.warn(
                f"pagedkern: the CUDA extension was not built ({exc}). pagedkern will run on its "
                "PyTorch reference ops; set PAGEDKERN_REQUIRE_CUDA=1 to make this an error."
            )

    def build_extension(self, ext: Extension) -> None:
        if not envs.ENV["PAGEDKERN_BUILD_CUDA"].get():
            raise RuntimeError("PAGEDKERN_BUILD_CUDA=0 was set")
        nvcc = _find_nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        cutlass = _find_cutlass_include()
        if cutlass is None:
            raise RuntimeError(
                "CUTLASS headers were not found: pip install --no-deps nvidia-cutlass, "
                "or set PAGEDKERN_CUTLASS_INCLUDE"
            )
        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        if cmake is None or ninja is None:
            raise RuntimeError("cmake and ninja are needed: pip install cmake ninja")
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        build_dir = ROOT / "build" / f"cmake-{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        archs = envs.ENV["PAGEDKERN_CUDA_ARCHS"].get()
        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPAGEDKERN_CUTLASS_INCLUDE={cutlass}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
        ]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(configure, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--", f"-j{jobs}"], check=True)


setup(
    ext_modules=[Extension("pagedkern._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
