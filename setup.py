"""Builds pagedkern._C with CMake + Ninja, and pagedkern._cpu (csrc/cpu/, the CPU backend's C++
kernels) with the host C++ compiler through setuptools (metadata lives in pyproject.toml).

Build environment variables (declared in BUILD_ENV below, parsed with the package's rules from
python/pagedkern/envs.py, loaded here by path since the package is not built yet; the package
itself never reads them):

- PAGEDKERN_BUILD_CUDA (default 1): 0 skips the CUDA build on purpose (pure-Python install,
  reference ops only).
- PAGEDKERN_REQUIRE_CUDA (unset: required exactly when CI=true): 1 makes a missing nvcc or a
  failing build an error; otherwise the package installs without _C, with a warning, and runs on
  the PyTorch reference ops. The tests read the same rule (tests/build_env.py): where the build
  is required, tests that need the built extension fail instead of skipping.
- PAGEDKERN_CUTLASS_INCLUDE: the CUTLASS include folder (holds cute/ and cutlass/); default: the
  nvidia-cutlass package.
- PAGEDKERN_CUDA_ARCHS (default 80-real;90a-real;80-virtual): the CMake CUDA architectures.

MAX_JOBS: parallel compile jobs (default: all cores).

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
BUILD_ENV = {
    v.name: v
    for v in (
        envs.EnvVar(
            "PAGEDKERN_BUILD_CUDA", "1", "0 skips the CUDA build.", envs.parse_bool, "build"
        ),
        envs.EnvVar(
            "PAGEDKERN_REQUIRE_CUDA",
            None,
            "1: a missing nvcc or a failing CUDA build is an error (unset: when CI=true).",
            envs.parse_bool,
            "build",
        ),
        envs.EnvVar(
            "PAGEDKERN_CUTLASS_INCLUDE", None, "CUTLASS include folder.", envs.parse_text, "build"
        ),
        envs.EnvVar(
            "PAGEDKERN_CUDA_ARCHS",
            "80-real;90a-real;80-virtual",
            "CMake CUDA architectures.",
            envs.parse_text,
            "build",
        ),
    )
}


def cuda_build_required() -> bool:
    """PAGEDKERN_REQUIRE_CUDA when set, else CI=true: a missing or failing CUDA build is an
    error here, and tests needing the built extension fail instead of skipping."""
    required = BUILD_ENV["PAGEDKERN_REQUIRE_CUDA"].get()
    return os.environ.get("CI") == "true" if required is None else required


def _find_nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def _find_cutlass_include() -> str | None:
    env = BUILD_ENV["PAGEDKERN_CUTLASS_INCLUDE"].get()
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
        inplace = self.inplace  # (setuptools clears it while building)
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure becomes a warning unless required
            if cuda_build_required():
                raise
            self.warn(
                f"pagedkern: the CUDA extension was not built ({exc}). pagedkern will run on its "
                "PyTorch reference ops; set PAGEDKERN_REQUIRE_CUDA=1 to make this an error."
            )
            if inplace:  # the CPU kernels built before the failure still go into the source tree
                self._copy_inplace(CPU_EXTENSION)

    def _copy_inplace(self, ext: Extension) -> None:
        fullname = self.get_ext_fullname(ext.name)
        built = Path(self.build_lib) / self.get_ext_filename(fullname)
        package_dir = self.get_finalized_command("build_py").get_package_dir("pagedkern")
        if built.is_file():
            self.copy_file(str(built), str(Path(package_dir) / built.name))

    def build_extension(self, ext: Extension) -> None:
        if ext.name == CPU_EXTENSION.name:
            return self._build_cpu_extension(ext)
        if not BUILD_ENV["PAGEDKERN_BUILD_CUDA"].get():
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
        archs = BUILD_ENV["PAGEDKERN_CUDA_ARCHS"].get()
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

    def _build_cpu_extension(self, ext: Extension) -> None:
        """pagedkern._cpu with the host C++ compiler; without one (or on a failure) the package
        installs without it and the CPU backend keeps torch's kernels."""
        msvc = self.compiler.compiler_type == "msvc"
        flags = ["/O2", "/std:c++17", "/fp:precise"] if msvc else ["-O3", "-std=c++17"]
        flags += [] if msvc else ["-ffp-contract=off"]
        # OpenMP: the GEMV's threads are torch's (libgomp); without it, one thread.
        openmp = [] if msvc or sys.platform == "darwin" else ["-fopenmp"]
        link = list(ext.extra_link_args)
        try:
            for omp in (openmp, []) if openmp else ([],):
                ext.extra_compile_args, ext.extra_link_args = flags + omp, link + omp
                try:
                    return super().build_extension(ext)
                except Exception:  # noqa: BLE001 - retried without OpenMP
                    if not omp:
                        raise
        except Exception as exc:  # noqa: BLE001 - optional: torch's CPU kernels stand in
            self.warn(
                f"pagedkern: the CPU kernels (pagedkern._cpu) were not built ({exc}); the CPU "
                "backend's quantized GEMMs will run torch's int-pack kernels. Install a C++ "
                "compiler (g++ or clang++) and reinstall to build them."
            )


def _cpu_extension() -> Extension:
    """pagedkern._cpu: csrc/cpu/ (x86 ISA paths chosen at run time), pybind11, no libtorch."""
    try:
        import pybind11

        include = [pybind11.get_include()]
    except ImportError:
        include = []
    return Extension(
        "pagedkern._cpu",
        sources=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.cpp")),
        depends=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.[hi]*")),
        include_dirs=include,
        extra_link_args=[] if os.name == "nt" else ["-pthread"],
        language="c++",
    )


CPU_EXTENSION = _cpu_extension()

# setuptools runs this file as __main__ (pip's build backend too); the tests load it by path
# for BUILD_ENV and cuda_build_required.
if __name__ == "__main__":
    setup(
        ext_modules=[CPU_EXTENSION, Extension("pagedkern._C", sources=[])],
        cmdclass={"build_ext": CMakeBuild},
    )
