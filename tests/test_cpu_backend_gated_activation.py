"""The CPU layer tail's gated activation (csrc/cpu/gated_activation.cpp): its AVX2 loop gives the
plain loop's bits on every input (NaN, infinities, both saturations of e^x, odd widths), and
both compute the reference's SiLU / GELU-tanh products (e^x by a polynomial: ~3e-7 relative)."""

from __future__ import annotations

import pytest
import torch

from pagedkern import reference
from pagedkern.ops.cpu import quant_gemv

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")


def _has_avx2() -> bool:
    module = quant_gemv.cpu_module() if quant_gemv.available() else None
    return module is not None and module.path_supported(module.PATHS["avx2"])


NEEDS_AVX2 = pytest.mark.skipif(not _has_avx2(), reason="this CPU has no AVX2")

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # layer_tail.h's Activation
REFERENCE = {"silu": reference.silu_and_mul, "gelu_tanh": reference.gelu_tanh_and_mul}
EDGES = [float("nan"), float("inf"), -float("inf"), 200.0, -200.0, 87.5, -88.5, 44.0, -44.2]
EDGES += [-0.0, 0.0, 1e-30, -1e-30, 3e38, -3e38]


def _run(act: str, g: torch.Tensor, simd: bool) -> torch.Tensor:
    rows, width = g.shape
    out = torch.full((rows, width // 2), float("nan"))  # poisoned: every element is written
    quant_gemv.cpu_module().gated_activation(
        activation=ACTIVATIONS[act], g=g.data_ptr(), out=out.data_ptr(), rows=rows,
        intermediate=width // 2, simd=simd,
    )  # fmt: skip
    return out


def _inputs(rows: int, intermediate: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, 2 * intermediate, generator=gen) * 30
    edges = torch.tensor(EDGES)
    where = torch.randint(
        0, rows * intermediate, (min(len(EDGES), rows * intermediate),), generator=gen
    )
    g[:, :intermediate].reshape(-1)[where] = edges[: len(where)]  # the activation's argument
    return g


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("intermediate", [1, 7, 8, 9, 37, 1541])
@NEEDS_AVX2
def test_the_avx2_loop_gives_the_plain_loops_bits(act, intermediate):
    g = _inputs(3, intermediate, seed=intermediate)
    plain, simd = _run(act, g, simd=False), _run(act, g, simd=True)
    # (NaN where the plain loop has NaN, the same bits everywhere else)
    assert torch.equal(plain.isnan(), simd.isnan())
    finite = ~plain.isnan()
    assert torch.equal(plain[finite].view(torch.int32), simd[finite].view(torch.int32))


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("simd", [False, pytest.param(True, marks=NEEDS_AVX2)])
def test_both_loops_compute_the_reference(act, simd):
    g = torch.randn(5, 2 * 301, generator=torch.Generator().manual_seed(7)) * 8
    got = _run(act, g, simd)
    assert not got.isnan().any()
    want = REFERENCE[act](g)
    # (GELU's tanh as 1 - 2 / (e^2u + 1) cancels near 0: an absolute bound, not a relative one)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_nan_in_an_argument_stays_in_its_element(act):
    g = torch.randn(1, 2 * 24, generator=torch.Generator().manual_seed(3))
    g[0, 5] = float("nan")
    got = _run(act, g, simd=True)
    assert got[0, 5].isnan()
    assert not got[0, torch.arange(24) != 5].isnan().any()
