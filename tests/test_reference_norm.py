"""The reference rms_norm, fused_add_rms_norm and silu_and_mul against plain float64 math.

The references compute in fp32 and round once to the input dtype, so against an exact float64
result the error is at most half an ulp of the output dtype (plus fp32 noise far below that for
fp16/bf16). For fp16/bf16 we also require almost every element to equal the correctly rounded
float64 value bit for bit: a second rounding or a bf16 intermediate would break that.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkern.reference import fused_add_rms_norm, rms_norm, silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [1, 111, 500, 4096]
LEAD = [(7,), (2, 3)]  # flat batch and [batch, seq] leading dims


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _assert_rounded_close(actual: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype):
    """actual (in dtype) within half an ulp (+ fp32 noise) of the exact float64 value."""
    assert actual.dtype == dtype
    assert actual.shape == exact.shape
    assert torch.isfinite(actual).all()
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), exact, rtol=1e-5, atol=1e-6)
        return
    # Half an ulp relative to the value: 2^-(mantissa bits + 1).
    half_ulp = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    torch.testing.assert_close(actual.double(), exact, rtol=half_ulp * 1.001, atol=1e-7)
    mismatched = (actual != exact.to(dtype)).double().mean().item()
    assert mismatched <= 0.01, f"{mismatched:.2%} of elements not correctly rounded"


def _rms_norm64(x64: torch.Tensor, w64: torch.Tensor, eps: float) -> torch.Tensor:
    """Textbook RMSNorm in float64: x / sqrt(mean(x^2) + eps) * w."""
    h = x64.shape[-1]
    ms = (x64 * x64).sum(-1, keepdim=True) / h
    return x64 / torch.sqrt(ms + eps) * w64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("lead", LEAD)
def test_rms_norm_matches_float64(dtype, hidden, lead):
    x = _randn((*lead, hidden), dtype, seed=hidden, scale=3.0)
    w = _randn((hidden,), dtype, seed=hidden + 1)
    x_before = x.clone()
    eps = 1e-6
    y = rms_norm(x, w, eps)
    _assert_rounded_close(y, _rms_norm64(x.double(), w.double(), eps), dtype)
    assert torch.equal(x, x_before), "rms_norm must not modify its input"


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 1.0])
def test_rms_norm_eps_is_inside_the_root(eps):
    # Small inputs make eps dominate, so eps placed outside the sqrt (or ignored) would show.
    x = _randn((4, 64), torch.float32, seed=3, scale=0.05)
    w = _randn((64,), torch.float32, seed=4)
    _assert_rounded_close(rms_norm(x, w, eps), _rms_norm64(x.double(), w.double(), eps), x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_out_argument(dtype):
    x = _randn((5, 111), dtype, seed=5)
    w = _randn((111,), dtype, seed=6)
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be overwritten
    result = rms_norm(x, w, 1e-5, out=out)
    assert result is out
    _assert_rounded_close(out, _rms_norm64(x.double(), w.double(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("lead", LEAD)
def test_fused_add_rms_norm_in_place(dtype, hidden, lead):
    x = _randn((*lead, hidden), dtype, seed=10 + hidden)
    residual = _randn((*lead, hidden), dtype, seed=20 + hidden, scale=4.0)
    w = _randn((hidden,), dtype, seed=30 + hidden)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    eps = 1e-6
    # The sum of two fp16/bf16/fp32 values is exact in float64, so this is the correctly
    # rounded residual that must be stored.
    new_residual = (x.double() + residual.double()).to(dtype)

    x_out, r_out = fused_add_rms_norm(x, residual, w, eps)

    assert x_out is x and r_out is residual, "must return its in-place arguments"
    assert x.data_ptr() == x_ptr and residual.data_ptr() == r_ptr
    assert torch.equal(residual, new_residual), "residual must be T(x + residual), rounded once"
    # The norm is of the *rounded* residual that was stored.
    _assert_rounded_close(x, _rms_norm64(new_residual.double(), w.double(), eps), dtype)
    # Documented invariant: afterwards x equals rms_norm(residual) bit for bit.
    assert torch.equal(x, rms_norm(residual, w, eps))


@pytest.mark.parametrize("dtype, big", [(torch.bfloat16, 256.0), (torch.float16, 2048.0)])
def test_fused_add_rms_norm_normalises_the_rounded_residual(dtype, big):
    # At `big` the dtype's spacing is 2, so big + 0.75 is stored as big. That shifts the RMS by
    # ~0.3 ulp, enough that normalising the exact (unrounded) sum fails the rounding check
    # for about a third of the elements (verified when this test was written).
    h = 64
    residual = _randn((1, h), dtype, seed=40, scale=0.5)
    x = _randn((1, h), dtype, seed=41, scale=0.5)
    residual[0, 0], x[0, 0] = big, 0.75
    w = torch.ones(h, dtype=dtype)
    fused_add_rms_norm(x, residual, w, 1e-6)
    assert residual[0, 0].item() == big
    _assert_rounded_close(x, _rms_norm64(residual.double(), w.double(), 1e-6), dtype)


def _silu_and_mul64(x64: torch.Tensor) -> torch.Tensor:
    d = x64.shape[-1] // 2
    gate, up = x64[..., :d], x64[..., d:]
    return gate / (1.0 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 64, 255, 1376])
@pytest.mark.parametrize("lead", LEAD)
def test_silu_and_mul_matches_float64(dtype, d, lead):
    x = _randn((*lead, 2 * d), dtype, seed=d, scale=3.0)
    x_before = x.clone()
    y = silu_and_mul(x)
    assert y.shape == (*lead, d)
    _assert_rounded_close(y, _silu_and_mul64(x.double()), dtype)
    assert torch.equal(x, x_before)


def test_silu_and_mul_halves_are_gate_then_up():
    # silu applies to the first half (gate) only: silu(2) * -1, not silu(-1) * 2.
    y = silu_and_mul(torch.tensor([[2.0, -1.0]]))
    assert y.item() == pytest.approx(-2.0 / (1.0 + math.exp(-2.0)), rel=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_out_argument(dtype):
    x = _randn((3, 2 * 33), dtype, seed=50)
    out = torch.full((3, 33), float("nan"), dtype=dtype)
    assert silu_and_mul(x, out=out) is out
    _assert_rounded_close(out, _silu_and_mul64(x.double()), dtype)
