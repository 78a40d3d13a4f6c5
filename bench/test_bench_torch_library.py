"""Host cost of the registered torch ops (`torch.ops.pagedkern.*`, ops/torch_library.py)
against the direct call of the same op, on tiny CPU tensors so the op's own work is small and the
difference is torch's dispatcher and custom-op wrapper. Timed with perf_counter over many calls,
median of rounds, both in the same run. The engine's hot loop calls the ops directly; this says
what a user pays for torch.compile-visible ops."""

from __future__ import annotations

import pytest
import torch
from measure import per_call_seconds

import pagedkern.ops as direct
from pagedkern.ops import torch_library  # noqa: F401 - registers torch.ops.pagedkern

ops = torch.ops.pagedkern


def _cases():
    x, w = torch.randn(1, 8), torch.randn(8)
    gate_up = torch.randn(1, 16)
    return {
        "rms_norm": (lambda: direct.rms_norm(x, w), lambda: ops.rms_norm(x, w)),
        "silu_and_mul": (lambda: direct.silu_and_mul(gate_up), lambda: ops.silu_and_mul(gate_up)),
    }


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul"])
def test_registered_vs_direct_call(record, smoke, op):
    plain, registered = _cases()[op]
    calls, rounds = (20, 3) if smoke else (5000, 15)
    for fn in (plain, registered):
        fn()
    t_direct = per_call_seconds(plain, calls, rounds)
    t_registered = per_call_seconds(registered, calls, rounds)
    record("torch.library host", f"{op} 1x8 CPU", "direct call", t_direct)
    record(
        "torch.library host",
        f"{op} 1x8 CPU",
        "torch.ops.pagedkern",
        t_registered,
        overhead_us=(t_registered - t_direct) * 1e6,
    )
    assert torch.equal(plain(), registered())
