"""What every kernel launch needs once its arguments are valid: the module, device and stream."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from types import ModuleType

from .._extension import require
from .arrays import ArrayView, common_device, current_stream, resolve_device

BACKENDS = ("auto", "cuda", "reference")
_backend = "auto"  # the process default (set_backend)
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("backend", default=None)


def set_backend(name: str) -> None:
    """'auto' (default): CUDA kernels for CUDA arrays, the reference for CPU tensors.
    'reference': the PyTorch reference everywhere, also on a GPU (A/B comparisons).
    'cuda': like auto (the engine uses it to insist on a GPU)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _scoped.get() or _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """The backend for this thread / task only, inside the block (an engine's forward passes);
    the process default and other threads are untouched."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    token = _scoped.set(name)
    try:
        yield
    finally:
        _scoped.reset(token)


def use_reference(views: Sequence[ArrayView]) -> bool:
    """Whether an op with these (validated) arguments runs on the reference."""
    return get_backend() == "reference" or common_device(views) == "cpu"


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
