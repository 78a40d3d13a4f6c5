"""CuPy arguments under CUDA-graph capture, on a device: an op that allocates its own output
inside a CuPy stream capture replays into memory nobody else was handed (ops/cupy_capture.py
keeps the arrays a capture made), after the pool was churned by arrays made and dropped since."""

from __future__ import annotations

import pytest

import pagedkern
from pagedkern.ops import cupy_capture
from pagedkern.ops.cupy_capture import capture_arrays, release_capture_arrays

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    # in the test, not at import: the GPU check's rehearsal collects this file where CuPy is absent
    return pytest.importorskip("cupy")


def _rms64(cp, x, w, eps=1e-6):
    x = x.astype(cp.float64)
    return x / cp.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(cp.float64)


def test_an_output_allocated_during_a_cupy_capture_stays_the_graphs(cp):
    rng = cp.random.RandomState(7)
    x = rng.standard_normal((9, 512)).astype(cp.float16)
    w = (1 + 0.5 * rng.standard_normal(512)).astype(cp.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    release_capture_arrays()
    with stream:
        pagedkern.rms_norm(x, w, 1e-6)  # warm-up: the kernel loaded outside the capture
        stream.synchronize()
        stream.begin_capture()
        out = pagedkern.rms_norm(x, w, 1e-6)  # allocates its output during the capture
        graph = stream.end_capture()
    assert capture_arrays() == 1
    kept = cp.asarray(cupy_capture._capture_arrays[0])  # (a torch tensor where torch is loaded)
    pointer = out.data.ptr
    assert kept.data.ptr == pointer
    del out  # the caller drops it; the graph still writes there
    churn = [cp.full((9, 512), 7, dtype=cp.float16) for _ in range(8)]  # reuse bait
    assert all(c.data.ptr != pointer for c in churn)
    x[...] = rng.standard_normal((9, 512)).astype(cp.float16)
    with stream:
        graph.launch()
    stream.synchronize()
    assert all(bool((c == 7).all()) for c in churn), "the replay wrote into another array"
    want = _rms64(cp, x, w)
    err = cp.linalg.norm(kept.astype(cp.float64) - want) / cp.linalg.norm(want)
    assert float(err) <= 2e-3
    release_capture_arrays()
