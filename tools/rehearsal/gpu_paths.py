"""pytest plugin (`-p gpu_paths`, this folder on PYTHONPATH) that runs the benchmark suites'
GPU-only branches on a CPU. With PAGEDKERN_BENCH_SMOKE=1 and PAGEDKERN_BENCH_GPU_PATHS=1 the
suites keep their smoke sizes and CPU tensors (their pagedkern calls run the reference) but take
every `measure.gpu_paths()` branch, where the device is a pretended Hopper (compute capability,
SM count) and `require()` returns a stub of the built extension: each entry point takes exactly
the arguments its pybind signature names (keyword-only), host-only functions run for real,
device queries answer for the pretended GPU, and kernel launches are refused (CPU tensors never
reach one). A misused or changed extension signature in a benchmark thus fails on the CPU, not
on a lent GPU. tests/test_bench_gpu_paths.py runs the GPU check's benchmark stage under it."""

from __future__ import annotations

import atexit
import inspect
import json
import os
import types

import pytest
import torch

import pagedkern._extension as extension

LOG_ENV = "PAGEDKERN_GPU_PATHS_LOG"  # where the stub's calls are written as JSON at exit
SMS = 132  # an H200's
CAPABILITY = (9, 0)
PATH_CODES = {"auto": 0, "sm80": 1, "sm90": 2}  # ops/flash_prefill.py's PATHS


class RehearsalError(AssertionError):
    """What the CPU rehearsal cannot do (a kernel launch) or does not know (a new entry point)."""


def _flash_prefill_path(*, device, head_dim, block_size, fp8_cache, path):
    # flash_prefill_select_path on the pretended Hopper (block size and alignment assumed fine):
    # path 1 when asked for, for an fp8 cache (path 2 does not read fp8) or head dim 256 (path 2
    # covers 64 and 128), else path 2.
    path_1 = path == PATH_CODES["sm80"] or fp8_cache or head_dim == 256
    return PATH_CODES["sm80"] if path_1 else PATH_CODES["sm90"]


HOST_ONLY = {"flash_prefill_workspace_ints", "build_info", "moe_padded_rows"}  # run for real
DEVICE_QUERIES = {
    "device_count": lambda: (1, ""),
    "compute_capability": lambda *, device: CAPABILITY,
    "multiprocessor_count": lambda *, device: SMS,
    "pointer_device": lambda *, address: 0,
    "flash_prefill_path": _flash_prefill_path,
}
LAUNCHES = {
    "rms_norm", "silu_and_mul", "rope_and_cache", "paged_attention", "flash_prefill", "sample",
    "quant_gemm", "quant_gemm_marlin", "rejection_sample", "PagedAttentionLaunch",
    "FlashPrefillLaunch",
    "moe_route", "moe_align", "moe_experts", "moe_experts_quant", "moe_experts_sm90",
}  # fmt: skip


def _split_top_level(text: str) -> list[str]:
    """Splits a parameter list at the commas outside brackets (types such as tuple[int, int])."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def pybind_signature(function) -> inspect.Signature:
    """The signature a pybind11 function states in the first line of its docstring, e.g.
    `f(*, total_q: int, batch: int) -> int`; a method's `self` left out."""
    line = function.__doc__.splitlines()[0]
    open_at, depth = line.index("("), 0
    for close_at in range(open_at, len(line)):
        depth += {"(": 1, ")": -1}.get(line[close_at], 0)
        if depth == 0:
            break
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in _split_top_level(line[open_at + 1 : close_at]):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name = part.split(":")[0].split("=")[0].strip()
        if name == "self":
            continue
        default = None if "=" in part else inspect.Parameter.empty
        params.append(inspect.Parameter(name, kind, default=default))
    return inspect.Signature(params)


class ExtensionStub(types.ModuleType):
    """The built extension's surface with its real signatures (see the module docstring)."""

    def __init__(self, real: types.ModuleType):
        super().__init__("pagedkern._C (CPU rehearsal stub)")
        self.calls: list[dict] = []
        for name in dir(real):
            if name.startswith("_"):
                continue
            entry = getattr(real, name)
            if not callable(entry):
                setattr(self, name, entry)  # constants (DTYPE_CODES, quant_gemm_max_m, ...)
            elif name in HOST_ONLY:
                setattr(self, name, self._checked(name, pybind_signature(entry), entry))
            elif name in DEVICE_QUERIES:
                setattr(self, name, self._checked(name, pybind_signature(entry), None))
            elif name in LAUNCHES:
                function = entry.__init__ if isinstance(entry, type) else entry
                setattr(self, name, self._checked(name, pybind_signature(function), None))
            else:
                raise RehearsalError(
                    f"pagedkern._C.{name} is new: classify it in {__file__} (host-only, a device "
                    "query or a launch)"
                )

    def _checked(self, name: str, signature: inspect.Signature, real):
        def call(*args, **kwargs):
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(
                    f"{name}(): incompatible function arguments ({exc}); the extension's "
                    f"signature is {name}{signature}"
                ) from None
            self.calls.append({"name": name, "kwargs": sorted(kwargs)})
            if name in LAUNCHES:
                raise RehearsalError(f"{name}: a kernel launch in the CPU rehearsal")
            if real is not None:
                return real(*args, **kwargs)
            return DEVICE_QUERIES[name](*args, **kwargs)

        call.__name__ = name
        call.__signature__ = signature
        return call


def _pretend_device() -> None:
    props = types.SimpleNamespace(
        name="pretended H200 (CPU rehearsal)",
        major=CAPABILITY[0],
        minor=CAPABILITY[1],
        multi_processor_count=SMS,
        total_memory=141 << 30,
        L2_cache_size=60 << 20,
    )
    torch.cuda.get_device_capability = lambda device=None: CAPABILITY
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.current_device = lambda: 0


def _install() -> ExtensionStub:
    if os.environ.get("PAGEDKERN_BENCH_SMOKE") != "1" or (
        os.environ.get("PAGEDKERN_BENCH_GPU_PATHS") != "1"
    ):
        raise pytest.UsageError(
            "gpu_paths needs PAGEDKERN_BENCH_SMOKE=1 and PAGEDKERN_BENCH_GPU_PATHS=1 (smoke "
            "sizes on the CPU, the GPU-only branches taken)"
        )
    real = extension.extension_module()
    if real is None:
        raise pytest.UsageError("gpu_paths needs the built extension (its real signatures)")
    stub = ExtensionStub(real)
    _pretend_device()
    # Before any benchmark module binds `require` (plugins load before conftests and tests);
    # flash_prefill.kernel_path imports it at each call. cuda_available() stays False.
    extension.require = lambda: stub
    log = os.environ.get(LOG_ENV)
    if log:
        atexit.register(_write_log, log, stub)
    return stub


def _write_log(path: str, stub: ExtensionStub) -> None:
    with open(path, "w") as f:
        json.dump(stub.calls, f)


STUB = _install()
