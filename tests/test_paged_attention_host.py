"""The host path of paged_attention on any machine (the extension stubbed, fake CUDA arrays): each
argument's array interface is read once per call, the structural checks run once per layout, and
that memo never lets a bad argument through. Counts, never timing (the per-call cost itself is in
bench/test_bench_paged_attention_host.py)."""

from __future__ import annotations

import importlib

import pytest
from fake_cuda_array import FakeCudaArray

launch_module = importlib.import_module("pagedkern.ops.launch")
pa_module = importlib.import_module("pagedkern.ops.paged_attention")


class CountingArray(FakeCudaArray):
    """A fake CUDA array that builds its interface dict on every read, as CuPy does, and counts
    the reads."""

    reads = 0

    @property
    def __cuda_array_interface__(self) -> dict:
        CountingArray.reads += 1
        return dict(self._interface)

    @__cuda_array_interface__.setter
    def __cuda_array_interface__(self, interface: dict) -> None:  # FakeCudaArray.__init__
        self._interface = interface


class StubExtension:
    def __init__(self) -> None:
        self.launches: list[dict] = []

    def pointer_device(self, *, address: int) -> int:
        return 0

    def multiprocessor_count(self, *, device: int) -> int:
        return 132

    def paged_attention(self, **kwargs) -> None:
        self.launches.append(kwargs)


@pytest.fixture
def stub(monkeypatch) -> StubExtension:
    ext = StubExtension()
    monkeypatch.setattr(launch_module, "require", lambda: ext)
    monkeypatch.setattr(launch_module, "_backend", "auto")
    monkeypatch.setattr(pa_module, "_CHECKED", pa_module.CheckedLayouts())
    launch_module.sm_count.cache_clear()
    return ext


def _args(batch=2, blocks=64, **changes) -> dict:
    """Arguments of a split launch (B=2, L=1024: the plan splits) with a caller's workspace."""
    args = dict(
        q=CountingArray((batch, 8, 64)),
        k_cache=CountingArray((batch * blocks, 2, 16, 64)),
        v_cache=CountingArray((batch * blocks, 2, 16, 64)),
        block_tables=CountingArray((batch, blocks), "int32"),
        seq_lens=CountingArray((batch,), "int32"),
        out=CountingArray((batch, 8, 64)),
        workspace=CountingArray((batch * 8 * 64 * 65,), "float32"),
    )
    args.update(changes)
    return args


def test_each_interface_is_read_once_per_call(stub):
    args = _args()
    pa_module.paged_attention(**args)
    assert stub.launches[-1]["num_splits"] > 1  # the workspace is in use
    before = CountingArray.reads
    for _ in range(5):
        pa_module.paged_attention(**args)
    assert CountingArray.reads - before == 5 * len(args)
    assert len(stub.launches) == 6


def test_checks_run_once_per_layout(stub):
    args = _args()
    pa_module.paged_attention(**args)
    first = pa_module._CHECKED.misses
    assert first == 2  # argument checks, then the kernel's layout checks
    for _ in range(5):
        pa_module.paged_attention(**args)
    assert pa_module._CHECKED.misses == first
    pa_module.paged_attention(**_args(batch=3))  # a new layout is checked again
    assert pa_module._CHECKED.misses == first + 2


# Each case: arguments that differ from a layout already checked and launched in one respect.
BAD = [
    (dict(q=CountingArray((2, 8, 64), "int32")), TypeError, r"q \(shape \(2, 8, 64\), dtype int32"),
    (dict(q=CountingArray((2, 8, 64), offset=4)), ValueError, "q .* 16-byte boundaries"),
    (dict(q=CountingArray((2, 8, 64), strides=(1024, 128, 1))), ValueError, "heads must be packed"),
    (dict(k_cache=CountingArray((128, 2, 16, 64), offset=4)), ValueError, "k_cache .* 16-byte"),
    (dict(v_cache=CountingArray((128, 2, 16, 64), "float32")), TypeError, "v_cache .* dtype of q"),
    (dict(block_tables=CountingArray((2, 64), "int32", strides=(128, 2))), ValueError, "rows must"),
    (dict(seq_lens=CountingArray((2,), "int32", strides=(2,))), ValueError, "seq_lens .* contig"),
    (dict(seq_lens=CountingArray((3,), "int32")), ValueError, r"block_tables .* shape \(3, \*\)"),
    (dict(out=CountingArray((2, 8, 64), offset=2)), ValueError, "out .* 16-byte boundaries"),
    (dict(out=CountingArray((2, 8, 32))), ValueError, r"out .* must have shape"),
    (
        dict(workspace=CountingArray((2 * 8 * 65 * 64,), "float16")),
        TypeError,
        "workspace .* float32",
    ),
    (
        dict(workspace=CountingArray((100,), "float32")),
        ValueError,
        "workspace .* need 4160 float32",
    ),
    (dict(workspace=CountingArray((70000,), "float32", offset=1)), ValueError, "workspace .* 16-b"),
    (dict(workspace=CountingArray((700, 100), "float32", strides=(200, 1))), ValueError, "contig"),
]


@pytest.mark.parametrize("changes,error,message", BAD)
def test_a_checked_layout_never_lets_a_bad_argument_through(stub, changes, error, message):
    pa_module.paged_attention(**_args())
    for _ in range(2):  # a failed check is not remembered: it fails again
        with pytest.raises(error, match=message):
            pa_module.paged_attention(**_args(**changes))
    assert len(stub.launches) == 1
    pa_module.paged_attention(**_args())
    assert len(stub.launches) == 2
