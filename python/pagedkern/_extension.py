"""Loading of the CUDA extension `pagedkern._C`, and why it may be unavailable.

The extension is optional at install time (no nvcc: pure-Python install) and at run time (no GPU
or driver, or a GPU older than the kernels' sm_80 floor). Everything that launches a kernel goes
through `require()`, which raises one clear error instead of crashing.
"""

from __future__ import annotations

import functools
import importlib
import re
from types import ModuleType

MIN_COMPUTE_CAPABILITY = (8, 0)  # cp.async, bf16 mma.sync: every kernel assumes sm_80


class CudaUnavailableError(RuntimeError):
    """A CUDA kernel was called where pagedkern cannot run one (the message says why)."""


def _import_compiled() -> ModuleType:
    # By name, not `from . import _C`: import graphs (grimp, import-linter) take that form for
    # an import of the package itself, a cycle that is not there.
    return importlib.import_module(f"{__package__}._C")


@functools.cache
def _probe() -> tuple[ModuleType | None, str | None]:
    try:
        _C = _import_compiled()
    except ImportError as exc:
        return None, (
            "the CUDA extension pagedkern._C is not installed or failed to load "
            f"({exc}); reinstall with nvcc available and PAGEDKERN_REQUIRE_CUDA=1 to see why"
        )
    if not hasattr(_C, "compute_capability"):  # a build from older sources: positional ABI
        return None, (
            f"the CUDA extension {_C.__file__} was built from older sources than this package; "
            "rebuild it (python setup.py build_ext --inplace, or reinstall)"
        )
    count, error = _C.device_count()
    if count == 0:
        return None, f"no CUDA device is usable ({error or 'the device count is 0'})"
    archs = str(_C.build_info().get("cuda_architectures", ""))
    for device in range(count):
        major, minor = _C.compute_capability(device=device)
        if not runs_on((major, minor), archs):
            return None, (
                f"CUDA device {device} is sm_{major}{minor}, which the kernels (built for "
                f"{archs or 'unknown architectures'}; sm_80 at least) cannot run on; hide it with "
                "CUDA_VISIBLE_DEVICES or use a newer GPU"
            )
    return _C, None


def runs_on(capability: tuple[int, int], archs: str) -> bool:
    """Whether a device of this compute capability can run a build for `archs` (CMake's list,
    e.g. "80-real,90a-real,80-virtual"): sm_80 or newer, and either machine code of its major
    version at or below its minor ("a" variants only on their exact GPU) or PTX it can JIT."""
    if capability < MIN_COMPUTE_CAPABILITY:
        return False
    entries = [
        re.fullmatch(r"(\d+)(\d)(a?)(?:-(real|virtual))?", e) for e in re.split(r"[;,\s]+", archs)
    ]
    if not any(entries):  # unknown or symbolic ("native", "all"): trust the sm_80 floor
        return True
    for m in entries:
        if m is None:
            continue
        built = (int(m[1]), int(m[2]))
        kinds = (m[4] or "real;virtual").split(";")
        if m[3] == "a":  # arch-specific machine code: that exact GPU only
            ok = built == capability
        else:  # SASS runs on its major version from its minor up; PTX JITs on anything newer
            same_major = built[0] == capability[0]
            ok = built <= capability and ("virtual" in kinds or same_major)
        if ok:
            return True
    return False


def extension_module() -> ModuleType | None:
    """The compiled module if it imports, whether or not a GPU is present (static checks use it)."""
    try:
        return _import_compiled()
    except ImportError:
        return None


def cuda_available() -> bool:
    """True when the CUDA kernels can run here: extension built and loaded, a device present."""
    return _probe()[0] is not None


def cuda_unavailable_reason() -> str | None:
    """Why `cuda_available()` is False, or None when it is True."""
    return _probe()[1]


def require() -> ModuleType:
    """The loaded extension, or CudaUnavailableError saying why there is none."""
    module, reason = _probe()
    if module is None:
        raise CudaUnavailableError(f"pagedkern cannot run CUDA kernels here: {reason}")
    return module
