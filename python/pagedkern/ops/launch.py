"""What every kernel launch needs once its arguments are valid: the module, device and stream;
and which variant of a kernel runs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from types import ModuleType

from .._extension import require
from .arrays import ArrayView, common_device, current_stream, resolve_device

# ---- kernel variants ---------------------------------------------------------------------------
# A rewritten kernel keeps the one it replaces selectable until a GPU run has verified the new
# one (README, Kernels). Op -> (environment variable, {name: code passed to the kernel}); the
# first name is the default. Codes match the `variant` field of the op's params (csrc/*.h).
KERNEL_VARIANTS: dict[str, tuple[str, dict[str, int]]] = {
    "flash_prefill": ("PAGEDKERN_FLASH_VARIANT", {"v2": 0, "v1": 1}),
    "rms_norm": ("PAGEDKERN_RMS_NORM_VARIANT", {"v3": 0, "v1": 1}),
    "rope_and_cache": ("PAGEDKERN_ROPE_VARIANT", {"v2": 0, "v1": 1}),
}


def kernel_variant(op: str) -> int:
    """The variant code of `op`'s kernel its environment variable asks for (default when unset)."""
    env, names = KERNEL_VARIANTS[op]
    name = os.environ.get(env, "").strip().lower() or next(iter(names))
    if name not in names:
        raise ValueError(f"{env} must be one of {', '.join(names)}, got {name!r}")
    return names[name]


BACKENDS = ("auto", "cuda", "reference")
_backend = "auto"


def set_backend(name: str) -> None:
    """'auto' (default): CUDA kernels for CUDA arrays, the reference for CPU tensors.
    'reference': the PyTorch reference everywhere, also on a GPU (A/B comparisons).
    'cuda': like auto (the engine uses it to insist on a GPU)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def use_reference(views: Sequence[ArrayView]) -> bool:
    """Whether an op with these (validated) arguments runs on the reference."""
    return _backend == "reference" or common_device(views) == "cpu"


def launch_context(views: Sequence[ArrayView], stream=None) -> tuple[ModuleType, int, int]:
    """(pagedkern._C, device index, stream handle); CudaUnavailableError where no kernel can run."""
    module = require()
    device = resolve_device(views, module)
    return module, device, current_stream(views, device, stream)


def reference_on_torch(op: str, views: Sequence[ArrayView]):
    """The reference module, for ops whose CUDA kernel has not landed yet: it runs on torch
    tensors wherever they live; other array libraries get a clear error."""
    if any(v.library != "torch" for v in views):
        raise NotImplementedError(
            f"{op} has no CUDA kernel yet; pass torch tensors to run pagedkern.reference.{op}"
        )
    from .. import reference

    return reference
