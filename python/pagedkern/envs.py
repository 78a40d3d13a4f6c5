"""Every PAGEDKERN_* environment variable: its name, default, meaning and parsing rule, in one
place. The rest of the tree reads them only through `ENV[name].get()` (or the helpers below), so
a value means the same everywhere and a malformed one is a ValueError naming the variable.

Standard library only: setup.py loads this file by path (the package is not importable before
it is built), so the build and the package agree on what, e.g., "build required" means.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, got {raw!r}")


def _text(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _shadow_mode(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value in ("on", "strict", "off"):
        return value
    return "on" if parse_bool(name, raw) else "off"


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower() or choices[0]
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        return value

    return parse


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str | None  # as it would be written in the environment; None: unset
    doc: str
    parse: Callable[[str, str], object]
    when: str  # "build", "run" or "test": who reads it

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self):
        """The parsed value (the parsed default when unset; None for an unset one without)."""
        raw = os.environ.get(self.name, self.default)
        return None if raw is None else self.parse(self.name, raw)


_VARS = (
    EnvVar(
        "PAGEDKERN_BUILD_CUDA",
        "1",
        "0 skips the CUDA build on purpose (pure-Python install, reference ops only).",
        parse_bool,
        "build",
    ),
    EnvVar(
        "PAGEDKERN_REQUIRE_CUDA",
        None,
        "1: a missing nvcc or a failing CUDA build is an error, and tests that need the built "
        "extension fail instead of skipping. Unset: required exactly when CI=true.",
        parse_bool,
        "build",
    ),
    EnvVar(
        "PAGEDKERN_CUTLASS_INCLUDE",
        None,
        "CUTLASS include folder (holds cute/ and cutlass/); default: the nvidia-cutlass package.",
        _text,
        "build",
    ),
    EnvVar(
        "PAGEDKERN_CUDA_ARCHS",
        "80-real;90a-real;80-virtual",
        "CMake CUDA architectures the kernels are compiled for.",
        _text,
        "build",
    ),
    EnvVar(
        "PAGEDKERN_FLASH_PREFILL_PATH",
        "auto",
        "flash_prefill kernel path: auto, sm80 (mma.sync everywhere) or sm90 (wgmma + TMA; an "
        "error where it cannot run).",
        _choice("auto", "sm80", "sm90"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_FLASH_VARIANT",
        "v2",
        "flash_prefill kernel schedule: v2 (page ids a tile ahead, softmax overlapping P·V on "
        "sm_90a) or v1 (the first schedule), selectable until a GPU run has verified v2.",
        _choice("v2", "v1"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_RMS_NORM_VARIANT",
        "v3",
        "rms_norm / fused_add_rms_norm kernel: v3 (weights loaded before the block barrier) or "
        "v1, selectable until a GPU run has verified v3.",
        _choice("v3", "v1"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_ROPE_VARIANT",
        "v2",
        "rope_and_cache kernel: v2 (4 heads per thread, one cos/sin load) or v1, selectable "
        "until a GPU run has verified v2.",
        _choice("v2", "v1"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_SAMPLE_VARIANT",
        "auto",
        "sample kernel: auto (what measured fastest on the H200, per call: v2 for plain sampling, "
        "v4 with logits processing or logprob outputs), v4 (v3 with a row split over several "
        "CTAs when the batch is below the SM count), v3 (processing, sampling and top-N logprobs "
        "in one kernel, warp-aggregated histograms) or v2 (processing stage + sampling kernel, "
        "top-N by torch ops).",
        _choice("auto", "v4", "v3", "v2"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_PAGED_ATTENTION_VARIANT",
        "auto",
        "paged_attention kernel: auto (mma for GQA groups >= 4 at D 64 / 128, else simt), simt "
        "(fp32 SIMT math, the first kernel) or mma (mma.sync tensor cores wherever D is 64 or "
        "128), selectable until a GPU run has verified mma.",
        _choice("auto", "simt", "mma"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_SHADOW",
        "off",
        "run: shadow mode for engines that do not set it (on: every op also runs its PyTorch "
        "reference and is compared, per op and layer; strict: stop at the first divergence; "
        "1 means on, 0 off)",
        _shadow_mode,
        "run",
    ),
    EnvVar(
        "PAGEDKERN_CHECK_INDICES",
        "0",
        "1: debug mode, the kernels trap on an out-of-range block id, slot, position or length "
        "(the tests turn it on); off it costs one branch on a kernel parameter.",
        parse_bool,
        "run",
    ),
    EnvVar(
        "PAGEDKERN_CACHE_DIR",
        None,
        "Folder of the converted-weights cache; default $XDG_CACHE_HOME/pagedkern, else "
        "~/.cache/pagedkern.",
        _text,
        "run",
    ),
    EnvVar(
        "PAGEDKERN_BENCH_SMOKE",
        None,
        "Benchmarks: 1 forces smoke mode (tiny CPU inputs, numbers meaningless), 0 forbids it; "
        "unset: smoke mode without a GPU.",
        parse_bool,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_BENCH_GPU_PATHS",
        None,
        "Benchmarks: 1 takes the suites' GPU-only branches on a CPU, under the stubbed extension "
        "of tools/rehearsal/gpu_paths.py (with PAGEDKERN_BENCH_SMOKE=1).",
        parse_bool,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_GPU_PATHS_LOG",
        None,
        "tools/rehearsal/gpu_paths.py: a file the stubbed extension writes its calls to (JSON).",
        _text,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_BENCH_JSON",
        None,
        "Benchmarks: also write the results table as JSON to this path.",
        _text,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_NO_EMULATION",
        "0",
        "1 skips the CPU emulator tests (tests/emulator, built with g++).",
        parse_bool,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_BENCH_COMPILE",
        "0",
        "Benchmarks: 1 adds the torch.compile baseline rows (minutes of cold inductor builds; "
        "tools/gpu_check.sh --compile sets it).",
        parse_bool,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_BENCH_PROFILE",
        None,
        "bench/test_bench_http_frontend.py: a folder; the HTTP front end runs under a sampling "
        "profiler, writes its counts there and the bench prints CPU µs per token per component.",
        _text,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_BLOCK_IMPORTS",
        None,
        "Tests: comma-separated top-level modules that raise ImportError under "
        "tools/rehearsal/sitecustomize.py (the GPU-check rehearsal's missing packages).",
        _text,
        "test",
    ),
    EnvVar(
        "PAGEDKERN_GPU_STAGES",
        None,
        "tools/gpu_check.sh: another stage plan instead of tools/gpu_stages.txt (its own tests).",
        _text,
        "test",
    ),
)
ENV: dict[str, EnvVar] = {v.name: v for v in _VARS}


def cuda_build_required() -> bool:
    """PAGEDKERN_REQUIRE_CUDA when set, else CI=true: a missing or failing CUDA build is an
    error (setup.py) and tests needing the built extension fail instead of skipping."""
    required = ENV["PAGEDKERN_REQUIRE_CUDA"].get()
    return os.environ.get("CI") == "true" if required is None else required


def get(name: str):
    """The parsed value of a declared variable (its parsed default when unset)."""
    return ENV[name].get()


def check_indices() -> bool:
    """PAGEDKERN_CHECK_INDICES: the kernels' debug-mode index checks (read at every launch)."""
    return ENV["PAGEDKERN_CHECK_INDICES"].get()
