"""CuPy arrays an op makes for itself (outputs, workspaces, parameter arrays: ops/arrays.py
empty_like / full_like, through ops/cupy_capture.py) while a CUDA graph captures: never from
CuPy's pool left to reuse them (it is not graph-aware), but from torch's caching allocator on
the capturing stream, kept alive until release_capture_arrays(); without torch from CuPy, kept
alive likewise. Outside a capture nothing changes. On the CPU a stand-in `cupy` module
simulates the capture and records which allocator each call reached
(tests/test_arrays_capture_gpu.py replays a real capture)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pagedkern.ops import arrays, cupy_capture
from pagedkern.ops.arrays import ArrayView

STREAM = 0x5EED


class FakeCupy(types.ModuleType):
    """What arrays.py and cupy_capture.py call on `cupy`; allocations are recorded, arrays are
    descriptions."""

    def __init__(self, capturing: bool) -> None:
        super().__init__("cupy")
        self.calls: list[tuple] = []
        stream = types.SimpleNamespace(ptr=STREAM, is_capturing=lambda: capturing)

        class Device:
            def __init__(self, index) -> None:
                self.index = index

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                return None

        def unowned(ptr, size, owner, device):
            return types.SimpleNamespace(ptr=ptr, size=size, owner=owner, device=device)

        self.cuda = types.SimpleNamespace(
            get_current_stream=lambda: stream,
            Device=Device,
            UnownedMemory=unowned,
            MemoryPointer=lambda memory, offset: ("pointer", memory, offset),
        )

    def empty(self, shape, dtype):
        self.calls.append(("cupy.empty", shape, dtype))
        return ("cupy array", shape, dtype)

    def full(self, shape, value, dtype):
        self.calls.append(("cupy.full", shape, value, dtype))
        return ("cupy array", shape, dtype, value)

    def ndarray(self, shape, dtype, pointer):
        return ("cupy view", shape, dtype, pointer)


def _cupy_view() -> ArrayView:
    return ArrayView("x", object(), 4096, (4, 8), (8, 1), "float16", 0, "cupy")


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(capturing: bool) -> FakeCupy:
        cupy = FakeCupy(capturing)
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        return cupy

    arrays.release_capture_arrays()
    yield install
    arrays.release_capture_arrays()


@pytest.fixture
def torch_buffers(monkeypatch):
    """cupy_capture._torch_buffer (torch.empty / torch.full on the capturing CUDA stream) as CPU
    tensors, each call recorded."""
    made: list[tuple] = []

    def buffer(device, shape, dtype, value, stream):
        made.append((device, shape, dtype, value, stream))
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        return t if value is None else t.fill_(value)

    monkeypatch.setattr(cupy_capture, "_torch_buffer", buffer)
    return made


def test_outside_a_capture_cupy_allocates_as_before(fake_cupy, torch_buffers):
    cupy = fake_cupy(capturing=False)
    v = _cupy_view()
    assert arrays.empty_like(v, (3,), "float32") == ("cupy array", (3,), "float32")
    assert arrays.full_like(v, (2,), 7, "int64") == ("cupy array", (2,), "int64", 7)
    assert cupy.calls == [("cupy.empty", (3,), "float32"), ("cupy.full", (2,), 7, "int64")]
    assert torch_buffers == [] and arrays.capture_arrays() == 0


def test_during_a_capture_torch_allocates_on_the_capturing_stream_and_keeps_them(
    fake_cupy, torch_buffers
):
    cupy = fake_cupy(capturing=True)
    v = _cupy_view()
    out = arrays.empty_like(v, (3, 5), "float32")
    params = arrays.full_like(v, (4,), 0.5, "float32")
    assert cupy.calls == []  # CuPy's pool never reached
    assert torch_buffers == [
        (0, (3, 5), "float32", None, STREAM),
        (0, (4,), "float32", 0.5, STREAM),
    ]
    assert arrays.capture_arrays() == 2
    kept = cupy_capture._capture_arrays
    for array, tensor, shape in zip((out, params), kept, ((3, 5), (4,)), strict=True):
        kind, got_shape, dtype, (_, memory, offset) = array
        assert (kind, got_shape, dtype, offset) == ("cupy view", shape, "float32", 0)
        # the CuPy array is the kept tensor's memory, which it also holds
        assert (memory.ptr, memory.size, memory.owner) == (
            tensor.data_ptr(),
            tensor.numel() * 4,
            tensor,
        )
    assert torch.equal(kept[1], torch.full((4,), 0.5))
    assert arrays.release_capture_arrays() == 2 and arrays.capture_arrays() == 0


def test_during_a_capture_without_torch_cupy_arrays_are_kept(fake_cupy, torch_buffers, monkeypatch):
    cupy = fake_cupy(capturing=True)
    real = cupy_capture._module
    monkeypatch.setattr(
        cupy_capture, "_module", lambda name: None if name == "torch" else real(name)
    )
    out = arrays.empty_like(_cupy_view(), (6,), "int32")
    assert cupy.calls == [("cupy.empty", (6,), "int32")] and torch_buffers == []
    assert cupy_capture._capture_arrays == [out]


def test_an_old_cupy_without_graph_capture_is_never_capturing(fake_cupy):
    cupy = fake_cupy(capturing=True)
    cupy.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=STREAM)
    assert not cupy_capture.cupy_capturing()
    arrays.empty_like(_cupy_view(), (1,), "float32")
    assert cupy.calls == [("cupy.empty", (1,), "float32")]
