"""Loading of the CUDA extension `pagedkern._C`, and why it may be unavailable.

The extension is optional at install time (no nvcc: pure-Python install) and at run time (no GPU
or driver). Everything that launches a kernel goes through `require()`, which raises one clear
error instead of crashing.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType


class CudaUnavailableError(RuntimeError):
    """A CUDA kernel was called where pagedkern cannot run one (the message says why)."""


@functools.cache
def _probe() -> tuple[ModuleType | None, str | None]:
    try:
        from . import _C
    except ImportError as exc:
        return None, (
            "the CUDA extension pagedkern._C is not installed or failed to load "
            f"({exc}); reinstall with nvcc available and PAGEDKERN_REQUIRE_CUDA=1 to see why"
        )
    count, error = _C.device_count()
    if count == 0:
        return None, f"no CUDA device is usable ({error or 'the device count is 0'})"
    return _C, None


def extension_module() -> ModuleType | None:
    """The compiled module if it imports, whether or not a GPU is present (static checks use it)."""
    try:
        from . import _C
    except ImportError:
        return None
    return _C


def cuda_available() -> bool:
    """True when the CUDA kernels can run here: extension built and loaded, a device present."""
    return _probe()[0] is not None


def cuda_unavailable_reason() -> str | None:
    """Why `cuda_available()` is False, or None when it is True."""
    return _probe()[1]


def cuda_build_required() -> bool:
    """CI and PAGEDKERN_REQUIRE_CUDA=1: a missing or failing CUDA build is an error."""
    return os.environ.get("CI") == "true" or os.environ.get("PAGEDKERN_REQUIRE_CUDA") == "1"


def require() -> ModuleType:
    """The loaded extension, or CudaUnavailableError saying why there is none."""
    module, reason = _probe()
    if module is None:
        raise CudaUnavailableError(f"pagedkern cannot run CUDA kernels here: {reason}")
    return module
