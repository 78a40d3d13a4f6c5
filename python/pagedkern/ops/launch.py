"""What every kernel launch needs once its arguments are valid: the backend's choice between the
CUDA kernel, the CPU backend's implementation (ops/cpu/) and the reference, which variant of a
kernel runs (ops/variants.py), then the module, device and stream."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from .. import envs
from .._extension import require
from .arrays import ArrayView, common_device, current_stream, resolve_device
from .support import KernelSupport, KernelUnsupportedError
from .variants import kernel_variant as kernel_variant  # re-exported: the ops read it here

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "cuda", "cpu", "reference")
_backend = "auto"  # the process default (set_backend)
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("backend", default=None)


def set_backend(name: str) -> None:
    """'auto' (default): CUDA kernels for CUDA arrays, the CPU backend for CPU tensors.
    'cpu': the CPU backend (ops/cpu/: an implementation chosen for speed where the op has one,
    else the reference, as its table says); CUDA arrays raise KernelUnsupportedError.
    'reference': the PyTorch reference everywhere, also on a GPU (A/B comparisons).
    'cuda': strict, the CUDA kernels only: an op whose arguments no kernel covers (CPU tensors,
    or a dtype / head dim / block size outside ops/support.py) raises KernelUnsupportedError."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _scoped.get() or _backend


def on_cpu_backend(device: torch.device) -> bool:
    """Whether tensors on `device` run on the CPU backend: CPU tensors under "cpu" or "auto"."""
    return device.type == "cpu" and get_backend() in ("auto", "cpu")


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
    """Whether an op with these (validated) arguments runs on the host's torch code (the
    reference, or the CPU backend on CPU tensors) rather than a CUDA kernel."""
    return get_backend() in ("reference", "cpu") or common_device(views) == "cpu"


def host_backend(views: Sequence[ArrayView]) -> str:
    """Which torch implementations an op off the CUDA kernels runs: "cpu" (ops/cpu/'s table)
    for CPU tensors under "auto" and "cpu", else "reference"."""
    if get_backend() == "reference" or common_device(views) != "cpu":
        return "reference"
    return "cpu"


# ---- launch counting ---------------------------------------------------------------------------
_launches: contextvars.ContextVar[Counter[str] | None] = contextvars.ContextVar(
    "launches", default=None
)


@contextlib.contextmanager
def count_launches() -> Iterator[Counter[str]]:
    """Host-side launches inside the block (this thread / task), by name: every pagedkern op
    (kernel and reference alike), the model's "gemm"s and "embedding", and one "graph_replay"
    per CUDA graph replayed (its kernels are launched by the driver, not the host). A nested
    block counts apart: the outer one sees none of the inner one's launches."""
    counter: Counter[str] = Counter()
    token = _launches.set(counter)
    try:
        yield counter
    finally:
        _launches.reset(token)


def record_launch(name: str) -> None:
    """One launch of `name` for count_launches (one ContextVar read when nothing counts)."""
    counter = _launches.get()
    if counter is not None:
        counter[name] += 1


_warned: set[tuple[str, str]] = set()  # (op, reason) pairs already reported


def kernel_or_reference(op: str, views: Sequence[ArrayView], support: KernelSupport) -> bool:
    """True: launch the op's CUDA kernel. False: run the reference, which is where the "reference"
    backend and CPU tensors go, and, under "auto", CUDA arrays outside kernel support (with a
    RuntimeWarning once per (op, reason)). Under "cuda" anything but the kernel raises. Every
    op passes here once per call: the launch counter's hook."""
    record_launch(op)
    reference = use_reference(views)
    if get_backend() == "cpu" and common_device(views) != "cpu":
        raise KernelUnsupportedError(
            f"{op}: the 'cpu' backend runs CPU tensors only (use 'auto' or 'cuda' on a GPU)"
        )
    if get_backend() == "cuda" and (reference or not support.supported):
        reason = support.reason or "CPU tensors"
        raise KernelUnsupportedError(
            f"{op}: no CUDA kernel for {reason}, and the 'cuda' backend never falls back to the "
            "reference (backend 'auto' runs it there, slowly)"
        )
    if reference:
        return False
    if support.supported:
        return True
    warn_fallback(op, support.reason, stacklevel=4)
    return False


def warn_fallback(op: str, reason: str, stacklevel: int = 2) -> None:
    """RuntimeWarning that `op` runs the reference on CUDA arrays, once per (op, reason) per
    process (the engine reports it at start-up; the op then stays quiet)."""
    if (op, reason) in _warned:
        return
    _warned.add((op, reason))
    warnings.warn(
        f"pagedkern: {op} runs the PyTorch reference on the GPU because its CUDA kernel does "
        f"not cover {reason}: slow, and not capturable in a CUDA graph",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


def check_indices() -> bool:
    """Whether kernels run with their debug-mode index checks (PAGEDKERN_CHECK_INDICES=1)."""
    return envs.check_indices()


@functools.cache
def sm_count(module, device: int) -> int:
    """The device's SM count (split plans size their grids by it); asked once per device."""
    return int(module.multiprocessor_count(device=device))


def launch_context(views: Sequence[ArrayView], stream=None) -> tuple[ModuleType, int, int]:
    """(pagedkern._C, device index, stream handle); CudaUnavailableError where no kernel can run."""
    module = require()
    device = resolve_device(views, module)
    return module, device, current_stream(views, device, stream)


def on_launch_stream(views: Sequence[ArrayView], device: int, handle: int):
    """The context in which an op allocates and fills its own arrays (outputs, workspaces,
    scalar parameters turned into arrays, torch post-processing): the launch stream made the
    current stream of the arrays' library. A fill is then ordered before the kernel, and the
    caching allocators of torch and CuPy tie each block to that stream, so a workspace freed
    on return is handed out again only to work queued after the kernel. A no-op when the
    launch stream is already the library's current one (the usual call) or the arrays live
    on the host (the emulator and recording stubs run host arrays through the kernel path)."""
    libraries = {v.library for v in views}
    if common_device(views) == "cpu":
        return contextlib.nullcontext()
    if "torch" in libraries:
        torch = sys.modules["torch"]
        if torch.cuda.current_stream(device).cuda_stream == handle:
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))
    if "cupy" in libraries:
        cupy = sys.modules["cupy"]
        if cupy.cuda.get_current_stream().ptr == handle:
            return contextlib.nullcontext()
        return cupy.cuda.ExternalStream(handle)
    return contextlib.nullcontext()  # plain interface objects: the op allocates nothing


def reference_on_torch(op: str, views: Sequence[ArrayView]):
    """For arguments no CUDA kernel runs: the namespace of the op's torch implementation, the
    CPU backend's (ops/cpu/, `host_backend`) or the reference module. Both run on torch tensors
    only; other array libraries get a clear error."""
    if any(v.library != "torch" for v in views):
        raise NotImplementedError(
            f"{op} has no CUDA kernel for these arguments; pass torch tensors to run "
            f"pagedkern.reference.{op}"
        )
    return host_ops(views)


def host_ops(views: Sequence[ArrayView]):
    """The CPU backend's implementations (ops.cpu.IMPLEMENTATIONS as attributes) or the
    reference module, as `host_backend` decides for these arguments."""
    if host_backend(views) == "cpu":
        from .cpu import implementations

        return implementations

    from .. import reference

    return reference
