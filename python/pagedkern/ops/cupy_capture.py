"""CuPy arrays made while a CUDA graph captures.

CuPy's memory pool is not graph-aware: an array an op allocates during a capture and drops on
return goes back to the pool, which hands it out again while the graph, holding its address,
still replays into it. So the arrays an op makes for itself from CuPy arguments (outputs,
workspaces, parameter arrays: arrays.empty_like / full_like) while CuPy's current stream (the
launch stream: launch.on_launch_stream) captures come from torch's caching allocator on that
stream when torch is loaded (inside torch.cuda.graph: the graph's private pool), else from
CuPy's pool, and either way are kept alive here until release_capture_arrays() (after the
graphs that use them are gone). Torch arguments need none of this: torch's allocator is
graph-aware.

torch and CuPy are looked up in sys.modules, never imported here (as in arrays.py).
"""

from __future__ import annotations

import sys


def _module(name: str):
    return sys.modules.get(name)


_capture_arrays: list = []


def cupy_capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph (CuPy without graph capture has
    no Stream.is_capturing, and then nothing captures)."""
    is_capturing = getattr(_module("cupy").cuda.get_current_stream(), "is_capturing", None)
    return bool(is_capturing()) if is_capturing is not None else False


def _torch_buffer(device: int, shape: tuple[int, ...], dtype: str, value, stream: int):
    """A torch tensor for capture_array, allocated (and filled) on CUDA stream `stream`."""
    torch = _module("torch")
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        if value is None:
            return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device}")
        return torch.full(shape, value, dtype=getattr(torch, dtype), device=f"cuda:{device}")


def capture_array(device: int, shape: tuple[int, ...], dtype: str, value=None):
    """A CuPy array of `shape` (filled with `value` unless None) that outlives the capture
    under way: see above."""
    cupy = _module("cupy")
    if _module("torch") is None:
        array = cupy.empty(shape, dtype) if value is None else cupy.full(shape, value, dtype)
        _capture_arrays.append(array)
        return array
    stream = cupy.cuda.get_current_stream().ptr
    tensor = _torch_buffer(device, shape, dtype, value, stream)
    _capture_arrays.append(tensor)
    # The pointer wrapped as it is (no __cuda_array_interface__ stream handshake, which would
    # order the capture stream after torch's current one in the middle of the capture).
    nbytes = tensor.numel() * tensor.element_size()
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), nbytes, tensor, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def capture_arrays() -> int:
    """How many arrays made during CUDA-graph captures are kept alive."""
    return len(_capture_arrays)


def release_capture_arrays() -> int:
    """Drop the arrays kept for CUDA graphs captured with CuPy arguments (call once those
    graphs are destroyed); returns how many were kept."""
    count = len(_capture_arrays)
    _capture_arrays.clear()
    return count
