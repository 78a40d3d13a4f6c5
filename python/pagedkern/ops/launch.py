"""What every kernel launch needs once its arguments are valid: the module, device and stream."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from .._extension import require
from .arrays import ArrayView, current_stream, resolve_device


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
