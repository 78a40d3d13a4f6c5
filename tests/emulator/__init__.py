"""CPU emulation of pagedkern's CUDA kernels: the .cu sources compiled by g++ against emu.h (CUDA
threads as coroutines, barriers and shuffles with divergence checks, cp.async deferred to its
wait) into a stand-in pagedkern._C, and a context manager that runs the op entries' kernel path
on CPU tensors through it. It checks the kernels' indexing, synchronisation and arithmetic where
no GPU is available; it says nothing about speed, and memory-model subtleties of real hardware
(warp scheduling, caches) are out of its reach.

    from emulator import available, emulated
    with emulated():
        pagedkern.paged_attention(q, k_cache, v_cache, tables, seq_lens)  # CPU tensors

Inside `emulated()` the op backend is "cuda" (strict): arguments outside kernel support raise
instead of running the reference, and leaving the block without a kernel launch (the runtime
counts them, `launches()`) fails, so no test can compare the reference with itself.

Needs g++, the CUDA headers and pybind11 (the build is cached under build/emulator/);
PAGEDKERN_NO_EMULATION=1 skips it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
# Kernels written in plain CUDA C++ (no inline PTX outside __CUDA_ARCH__ guards, no CuTe).
KERNELS = (
    "rms_norm.cu",
    "silu_and_mul.cu",
    "paged_attention.cu",
    "rope_and_cache.cu",
    "sampling.cu",
    "rejection_sampling.cu",
    "sampling_fused.cu",
    "sampling_split.cu",
    "quant_gemm.cu",
    "quant_gemm_marlin.cu",  # mma.sync and ldmatrix through mma_fragments.cuh
    "moe_route.cu",
    "moe_gemm.cu",  # mma.sync through mma_fragments.cuh's warp-shuffle spelling
    "moe_gemm_quant.cu",  # W4A16 / W8A16 experts, the same mma.sync spelling
)
LAUNCH = re.compile(
    r"(?P<kern>[A-Za-z_][\w:]*(?:<[^;<>]*>)?)\s*<<<(?P<cfg>[^;]*?)>>>\s*\((?P<args>[^;]*)\)\s*;"
)


def _cuda_include() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c) / "include"
    return None


def unavailable_reason() -> str | None:
    from pagedkern.envs import parse_bool

    if parse_bool("PAGEDKERN_NO_EMULATION", os.environ.get("PAGEDKERN_NO_EMULATION", "0")):
        return "PAGEDKERN_NO_EMULATION=1"
    if shutil.which("g++") is None:
        return "g++ not found"
    if _cuda_include() is None:
        return "CUDA headers (cuda_runtime.h) not found"
    if importlib.util.find_spec("pybind11") is None:
        return "pybind11 not installed"
    return None


def available() -> bool:
    return unavailable_reason() is None


def _rewrite(text: str) -> str:
    """`k<<<grid, block, smem, stream>>>(args);` -> `::emu::launch(k, grid, ..., args);`"""

    def repl(m: re.Match) -> str:
        args = m["args"].strip()
        return f"::emu::launch({m['kern']}, {m['cfg']}{', ' + args if args else ''});"

    return LAUNCH.sub(repl, text)


def _compile(src: Path, obj: Path, includes: list[str]) -> Path:
    cmd = ["g++", "-std=c++20", "-O1", "-fPIC", "-Wno-unknown-pragmas", "-include"]
    cmd += [str(HERE / "emu.h"), "-I", str(CSRC), *includes, "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"emulator build of {src.name} failed:\n{proc.stderr[-4000:]}")
    return obj


def _cutlass_include() -> list[str]:
    """As setup.py finds it: the bindings may include headers that need CUTLASS/CuTe."""
    from build_env import build_variable

    path = build_variable("PAGEDKERN_CUTLASS_INCLUDE")
    spec = importlib.util.find_spec("cutlass_library")
    if not path and spec and spec.submodule_search_locations:
        path = str(Path(next(iter(spec.submodule_search_locations))) / "source" / "include")
    return ["-isystem", path] if path and Path(path).is_dir() else []


def build() -> Path:
    """Builds (or reuses) the emulated module; returns the path of its .so."""
    import pybind11

    includes = ["-I", str(_cuda_include()), "-I", sysconfig.get_paths()["include"]]
    includes += ["-I", pybind11.get_include(), *_cutlass_include()]
    sources = [CSRC / k for k in KERNELS] + sorted((CSRC / "bindings").glob("*.cpp"))
    digest = hashlib.sha256()
    headers = [
        *sorted(CSRC.glob("*.h")),
        *sorted(CSRC.glob("*.cuh")),
        CSRC / "bindings" / "bindings.h",
    ]
    for f in [*sources, *headers, HERE / "emu.h"]:
        digest.update(f.name.encode() + f.read_bytes())
    digest.update((HERE / "emu_runtime.cpp").read_bytes())
    out = ROOT / "build" / "emulator" / digest.hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = out / f"_C{suffix}"
    if target.exists():
        return target
    out.mkdir(parents=True, exist_ok=True)
    # One builder per directory: test processes started together (pytest-xdist's workers, two
    # runs in one checkout) wait for the first one's build instead of writing the same files.
    with open(out / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():  # (built while this process waited)
            _build_into(out, target, sources, includes, suffix)
    return target


def _build_into(
    out: Path, target: Path, sources: list[Path], includes: list[str], suffix: str
) -> None:
    jobs = []
    for src in sources:
        if src.suffix == ".cu":
            dst = out / (src.stem + ".cpp")
            dst.write_text(_rewrite(src.read_text()))
            src = dst
        # (a binding file and its kernel's share a stem: bindings/sampling.cpp, sampling.cu)
        jobs.append((src, out / (src.parent.name + "_" + src.stem + ".o")))
    jobs.append((HERE / "emu_runtime.cpp", out / "emu_runtime.o"))
    with ThreadPoolExecutor(2) as pool:
        objs = list(pool.map(lambda j: _compile(j[0], j[1], includes), jobs))
    # The bindings also bind kernels that are not emulated: stubs that throw.
    nm = subprocess.run(["nm", *map(str, objs)], check=True, capture_output=True, text=True).stdout
    defined = {ln.split()[-1] for ln in nm.splitlines() if len(ln.split()) == 3}
    missing = {
        ln.split()[-1] for ln in nm.splitlines() if ln.split()[:1] == ["U"] and "9pagedkern" in ln
    } - defined
    stub = out / "stubs.cpp"
    lines = [
        "#include <stdexcept>",
        'extern "C" void emu_not_emulated() { throw std::runtime_error("not emulated"); }',
    ]
    lines += [f'asm(".globl {m}\\n.set {m}, emu_not_emulated");' for m in sorted(missing)]
    stub.write_text("\n".join(lines) + "\n")
    objs.append(_compile(stub, out / "stubs.o", includes))
    tmp = out / f"_C.tmp{suffix}"
    subprocess.run(["g++", "-shared", "-o", str(tmp), *map(str, objs)], check=True)
    tmp.rename(target)


def load():
    """The emulated module (built on first use)."""
    name = "pagedkern_emulated._C"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, build())
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def launches() -> int:
    """Kernel launches the emulated runtime has run so far (grids, including the merge and
    check kernels)."""
    return ctypes.CDLL(load().__file__).emu_launch_count()


@contextlib.contextmanager
def emulated(expect_launch: bool = True):
    """Within: pagedkern ops run their kernel path on CPU tensors through the emulated module,
    under the strict "cuda" backend. On leaving, AssertionError if no kernel was launched
    (expect_launch=False for blocks that test a refusal)."""
    import pagedkern.ops  # noqa: F401  (loads every op module)
    from pagedkern.ops import launch

    module = load()
    saved = []

    def patch(obj, attr, value):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    patch(launch, "require", lambda: module)
    patch(launch, "current_stream", lambda views, device, stream=None: 0)
    patch(launch, "use_reference", lambda views: False)
    before = launches()
    try:
        with launch.use_backend("cuda"):
            yield module
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)
    if expect_launch and launches() == before:
        raise AssertionError("no kernel ran inside emulated(): the test compared nothing")
