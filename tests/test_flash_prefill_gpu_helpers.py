"""tests/test_flash_prefill_gpu.py's own logic on the CPU (its helpers run on DEVICE "cpu"): the
references it caches per batch are those of the q the kernel saw. The first GPU run failed
flash_prefill v1 on a side stream (max error 2.89) because the stream test, run after v2, wrote
another random q and got v2's cached reference back."""

from __future__ import annotations

import pytest
import test_flash_prefill_gpu as gpu_tests
import torch

from pagedkern import reference


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(gpu_tests, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_tests, "_references", {})


def test_a_cached_reference_is_of_the_current_q(on_the_cpu):
    batch = gpu_tests.make_batch([(20, 5), (3, 0)], 4, 64, torch.float32, 16, seed=4)
    q, rest, scale = batch[0], batch[1:], 64**-0.5
    first = gpu_tests.references(("stream",), *batch, scale)[0].clone()
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(1)))  # a next run's q
    second = gpu_tests.references(("stream",), *batch, scale)[0]
    want = reference.flash_prefill(q.float(), *[t.float() if t.is_floating_point() else t
                                                for t in rest], scale)  # fmt: skip
    assert not torch.equal(first, want)
    torch.testing.assert_close(second, want, rtol=0, atol=0, equal_nan=True)
