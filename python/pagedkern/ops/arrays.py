"""Caller arrays as raw device memory, and the argument checks every op shares.

An op receives torch tensors, CuPy arrays or any object exposing `__cuda_array_interface__`
(version 2 or 3). `view(obj, name)` turns each into an `ArrayView`: pointer, shape, strides in
elements, dtype name, device ('cpu' or a CUDA index) and the library it came from. The checks
raise TypeError (wrong kind or dtype) or ValueError (shape, layout, device) naming the argument
with its shape and dtype, before anything reaches the GPU.

torch and CuPy are looked up in sys.modules, never imported here: a tensor of a library can only
exist once that library is loaded. The arrays an op makes for itself from CuPy arguments while a
CUDA graph captures come from cupy_capture.py.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Re-exported: callers release the capture arrays through this module too.
from .cupy_capture import capture_array, cupy_capturing
from .cupy_capture import capture_arrays as capture_arrays
from .cupy_capture import release_capture_arrays as release_capture_arrays

# Codes understood by csrc/common.cuh (enum DType).
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int32": 3, "int64": 4}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1,
    "float8_e4m3fn": 1,
}  # fmt: skip
_TYPESTR = {"<f4": "float32", "<f2": "float16", "<i4": "int32", "<i8": "int64", "|u1": "uint8"}


def _module(name: str):
    return sys.modules.get(name)


# Not frozen: a frozen dataclass costs ~1 us per construction (object.__setattr__ per field),
# several per op call; views are never modified after view() builds them.
@dataclass(slots=True)
class ArrayView:
    name: str
    obj: object
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    device: str | int | None  # 'cpu', a CUDA device index, or None (CUDA, device unknown)
    library: str  # 'torch', 'cupy' or 'cai'
    stream: object = None  # a plain interface's "stream" entry (v3: the producer's stream)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def on_host(self) -> bool:
        return self.device == "cpu"

    def describe(self) -> str:
        where = "cpu" if self.on_host else f"cuda:{self.device if self.device is not None else '?'}"
        return f"{self.name} (shape {self.shape}, dtype {self.dtype}, {where})"

    def is_contiguous(self) -> bool:
        if self.numel == 0:  # (no element is out of place; torch's strides for [B, 0]: (1, 1))
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


_TORCH_DTYPES: dict = {}  # torch.dtype -> name, filled on first sight of each dtype


def _torch_view(obj, name: str) -> ArrayView:
    dtype = _TORCH_DTYPES.get(obj.dtype)
    if dtype is None:
        dtype = _TORCH_DTYPES.setdefault(obj.dtype, str(obj.dtype).removeprefix("torch."))
    where = obj.device
    if where.type == "cuda":
        device = where.index
    elif where.type == "cpu":
        device = "cpu"
    else:
        raise ValueError(f"{name} must be a CPU or CUDA tensor, got device {where}")
    return ArrayView(
        name, obj, obj.data_ptr(), tuple(obj.shape), obj.stride(), dtype, device, "torch"
    )


@functools.lru_cache(maxsize=4096)
def _cai_layout(name: str, shape: tuple, byte_strides: tuple | None, itemsize: int):
    """(shape, strides in elements) of an interface's shape and byte strides: a pure function of
    its arguments, so each distinct layout is derived once (the per-call host cost of an op)."""
    shape = tuple(int(s) for s in shape)
    if byte_strides is None:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return shape, tuple(reversed(strides))
    if any(s % itemsize for s in byte_strides):
        raise ValueError(f"{name} has byte strides {byte_strides} not divisible by {itemsize}")
    return shape, tuple(int(s) // itemsize for s in byte_strides)


def _cai_view(obj, cai, name: str) -> ArrayView:
    try:
        typestr, shape, ptr = cai["typestr"], cai["shape"], cai["data"][0]
    except (TypeError, KeyError, IndexError):
        ptr = None
    if ptr is None or not isinstance(cai, dict):
        raise TypeError(f"{name}: malformed __cuda_array_interface__ {cai!r}")
    dtype = _TYPESTR.get(typestr)
    if dtype is None:
        if typestr == "<V2" and str(getattr(obj, "dtype", "")) == "bfloat16":
            dtype = "bfloat16"  # bfloat16 has no typestr of its own (CuPy with ml_dtypes)
        else:
            raise TypeError(f"{name} has unsupported element type {typestr!r}")
    strides = cai.get("strides")
    if type(shape) is not tuple:  # the cache needs hashable keys (the protocol says tuples)
        shape = tuple(shape)
    if strides is not None and type(strides) is not tuple:
        strides = tuple(strides)
    shape, strides = _cai_layout(name, shape, strides, ITEMSIZE[dtype])
    ptr = int(ptr)
    library = "cai"
    device = None
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        library, device = "cupy", obj.device.id
    return ArrayView(name, obj, ptr, shape, strides, dtype, device, library, cai.get("stream"))


def view(obj, name: str) -> ArrayView:
    """View of a torch tensor, CuPy array or __cuda_array_interface__ object, else TypeError."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_view(obj, name)
    # Read once: CuPy (and others) build the interface dict on every access.
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _cai_view(obj, cai, name)
    raise TypeError(
        f"{name} must be a torch tensor, a CuPy array or an object with __cuda_array_interface__, "
        f"got {type(obj).__module__}.{type(obj).__qualname__}"
    )


def layout_key(views: Iterable[ArrayView]) -> tuple:
    """Everything the structural checks read of these views (shape, strides, dtype, device,
    library, 16-byte alignment of the pointer), as one hashable key: arguments with a key seen
    to pass the checks pass them again (`CheckedLayouts`)."""
    return tuple((a.shape, a.strides, a.dtype, a.device, a.library, a.ptr % 16 == 0) for a in views)


class CheckedLayouts:
    """Keys (`layout_key` plus anything else the checks read) of argument sets whose checks have
    passed, so that an op with the same layouts as before skips them; a failing check raises
    before its key is added, so bad arguments are checked, and rejected, on every call.
    Bounded: cleared when full (a call site sees few distinct layouts)."""

    def __init__(self, maxsize: int = 4096) -> None:
        self._passed: dict[tuple, int] = {}
        self._maxsize = maxsize
        self.misses = 0  # checks run (a test bounds them, never timing)

    def level(self, key: tuple) -> int:
        """The highest stage of checks this key has passed (0: none yet)."""
        return self._passed.get(key, 0)

    def passed(self, key: tuple, level: int) -> None:
        self.misses += 1
        if len(self._passed) >= self._maxsize:
            self._passed.clear()
        self._passed[key] = level


def check_dtype(a: ArrayView, allowed: Sequence[str]) -> None:
    if a.dtype not in allowed:
        raise TypeError(f"{a.describe()}: dtype must be one of {', '.join(allowed)}")


def check_same_dtype(a: ArrayView, b: ArrayView) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{b.describe()} must have the dtype of {a.describe()}")


def check_ndim(a: ArrayView, ndim: int) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{a.describe()} must have {ndim} dimensions")


def check_shape(a: ArrayView, shape: Sequence[int | None]) -> None:
    """None in `shape` matches any size."""
    if len(shape) != a.ndim or any(s is not None and s != t for s, t in zip(shape, a.shape)):
        wanted = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{a.describe()} must have shape {wanted}".replace("'*'", "*"))


def check_contiguous(a: ArrayView) -> None:
    if not a.is_contiguous():
        raise ValueError(f"{a.describe()} must be contiguous, got strides {a.strides}")


def check_own_elements(a: ArrayView) -> None:
    """An array an op writes: no two elements at one address (a broadcast view, stride 0, would
    have a kernel write one place many times, racing, or rotate it many times over).
    Conservatively: its dimensions by stride, each stride past the span of those below it."""
    span = 1  # elements the smaller dimensions reach
    for stride, n in sorted((abs(s), n) for n, s in zip(a.shape, a.strides) if n > 1):
        if stride < span:
            raise ValueError(
                f"{a.describe()}: its elements overlap in memory (strides {a.strides}); an "
                "array an op writes needs its own memory for each element"
            )
        span += stride * (n - 1)


def _byte_span(a: ArrayView) -> tuple[int, int]:
    """[first, last) bytes an array's elements can touch (empty arrays touch nothing)."""
    if a.numel == 0:
        return a.ptr, a.ptr
    itemsize = ITEMSIZE[a.dtype]
    extent = sum((n - 1) * abs(s) for n, s in zip(a.shape, a.strides, strict=True))
    low = a.ptr + itemsize * sum(
        (n - 1) * s for n, s in zip(a.shape, a.strides, strict=True) if s < 0
    )
    return low, low + (extent + 1) * itemsize


def check_disjoint(a: ArrayView, b: ArrayView) -> None:
    """a and b must not share memory (conservatively: their byte spans must not overlap)."""
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a0 < b1 and b0 < a1:
        raise ValueError(
            f"{a.describe()} and {b.describe()} overlap in memory; pass distinct arrays"
        )


def rows_of(a: ArrayView) -> tuple[int, int]:
    """(rows, row stride) of an array read as rows of its last dimension.

    The last dimension must be contiguous and the leading ones must collapse into one strided
    dimension (any 2-D slice with unit inner stride qualifies, as do contiguous N-D arrays).
    """
    if a.ndim == 0:
        raise ValueError(f"{a.describe()} must have at least one dimension")
    if a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{a.describe()}: the last dimension must be contiguous (stride 1)")
    rows = a.numel // a.shape[-1] if a.shape[-1] else 0
    lead = [(n, s) for n, s in zip(a.shape[:-1], a.strides[:-1]) if n != 1]
    for (_, outer), (n, inner) in zip(lead, lead[1:]):
        if outer != inner * n:
            raise ValueError(
                f"{a.describe()}: leading dimensions must collapse into rows (strides {a.strides})"
            )
    return rows, lead[-1][1] if lead else a.shape[-1]


def common_device(arrays: Iterable[ArrayView]) -> str | int | None:
    """The one device all arrays live on ('cpu' or a CUDA index); ValueError if they differ."""
    # One pass: the first array on the host, on CUDA, on a known CUDA device, on another one.
    host = cuda = known = other = None
    for a in arrays:
        if a.device == "cpu":
            host = host or a
        else:
            cuda = cuda or a
            if a.device is not None:
                known = known or a
                if other is None and a.device != known.device:
                    other = a
    if host is not None and cuda is not None:
        raise ValueError(f"{host.describe()} and {cuda.describe()} must be on the same device")
    if host is not None:
        return "cpu"
    if other is not None:
        raise ValueError(f"{known.describe()} and {other.describe()} must be on the same device")
    return known.device if known is not None else None


def resolve_device(arrays: Sequence[ArrayView], module) -> int:
    """CUDA device index of the arrays, asking the driver for pointers of unknown ownership."""
    device = common_device(arrays)
    if isinstance(device, int):
        return device
    owners = {module.pointer_device(address=a.ptr) for a in arrays if a.ptr}
    if -1 in owners:
        raise ValueError("an argument's pointer is not CUDA device memory")
    if len(owners) > 1:
        raise ValueError(f"arguments live on different devices {sorted(owners)}")
    return owners.pop() if owners else 0


def current_stream(arrays: Sequence[ArrayView], device: int, stream=None) -> int:
    """Handle of the stream to launch on: `stream` if given (int, torch/CuPy stream), else the
    caller's current stream of the library the arrays came from."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)
    libraries = {a.library for a in arrays}
    if "torch" in libraries:
        return _module("torch").cuda.current_stream(device).cuda_stream
    if "cupy" in libraries:
        return _module("cupy").cuda.get_current_stream().ptr
    for a in arrays:  # __cuda_array_interface__ v3: the producer's stream
        if isinstance(a.stream, int):
            return a.stream
    return 0


def empty_like(a: ArrayView, shape: tuple[int, ...], dtype: str | None = None, name: str = "out"):
    """A new array on a's device from a's library; generic CAI objects need an explicit out=."""
    dtype = dtype or a.dtype
    if a.library == "torch":
        torch = _module("torch")
        return torch.empty(shape, dtype=getattr(torch, dtype), device=a.obj.device)
    if a.library == "cupy":
        cupy = _module("cupy")
        with cupy.cuda.Device(a.device):
            try:
                if cupy_capturing():
                    return capture_array(a.device, shape, dtype)
                return cupy.empty(shape, dtype=dtype)
            except TypeError as exc:
                raise TypeError(f"CuPy cannot allocate {dtype}; pass {name}= explicitly") from exc
    raise TypeError(f"{a.describe()} is a plain __cuda_array_interface__ object: pass {name}=")


def full_like(a: ArrayView, shape: tuple[int, ...], value, dtype: str):
    """An array of `value` on a's device from a's library (turns scalar parameters into arrays)."""
    if a.library == "torch":
        torch = _module("torch")
        return torch.full(shape, value, dtype=getattr(torch, dtype), device=a.obj.device)
    if a.library == "cupy":
        cupy = _module("cupy")
        with cupy.cuda.Device(a.device):
            if cupy_capturing():
                return capture_array(a.device, shape, dtype, value)
            return cupy.full(shape, value, dtype=dtype)
    raise TypeError(f"{a.describe()} is a plain __cuda_array_interface__ object: pass arrays")
