"""rms_norm and fused_add_rms_norm kernels vs float64 math, on the GPU: every dtype, odd and
large shapes, strided and misaligned rows (scalar path), in place, foreign streams, CuPy."""

from __future__ import annotations

import pytest
import torch
from kernel_check import REL_TOLERANCE, assert_close_to, every_variant, poisoned

import pagedkern

pytestmark = pytest.mark.gpu
kernel_variant = every_variant("rms_norm")  # every test on every variant of the kernel

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# 1 row; odd hidden sizes (scalar path); model sizes; 8192 x 4096; beyond the register path.
SHAPES = [
    (1, 4096),
    (1, 111),
    (7, 500),
    (3, 576),
    (129, 2048),
    (2, 8192),
    (3, 16384),
    (8192, 4096),
    (2, 40000),
]
EPS = 1e-6


def rms_norm64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w.double()


def inputs(rows, hidden, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype) * 3
    w = (1 + 0.5 * torch.randn(hidden, generator=g, device="cuda")).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_rms_norm(rows, hidden, dtype):
    x, w = inputs(rows, hidden, dtype, seed=rows * hidden)
    out = poisoned((rows, hidden), dtype, "cuda")
    pagedkern.rms_norm(x, w, EPS, out=out)
    assert_close_to(out, rms_norm64(x, w), dtype)
    assert_close_to(pagedkern.rms_norm(x, w, EPS), rms_norm64(x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_fused_add_rms_norm(rows, hidden, dtype):
    x, w = inputs(rows, hidden, dtype, seed=rows + hidden)
    residual = torch.randn_like(x)
    expected_residual = (x.float() + residual.float()).to(dtype)
    pagedkern.fused_add_rms_norm(x, residual, w, EPS)
    # The residual is one fp32 add rounded once: bit-exact with torch.
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close_to(x, rms_norm64(expected_residual, w), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_misaligned_and_in_place_rows(dtype):
    hidden = 1024
    base, w = inputs(64, hidden + 9, dtype, seed=5)
    w = w[:hidden].contiguous()
    strided = base[:, :hidden]  # row stride 1033 elements: not a multiple of 8 -> scalar path
    aligned = torch.randn(64, hidden + 8, device="cuda").to(dtype)[:, 8:]  # vector path, stride
    misaligned = base[:, 1 : hidden + 1]  # 2-byte offset -> scalar path
    for x in (strided, aligned, misaligned):
        expected = rms_norm64(x, w)
        assert_close_to(pagedkern.rms_norm(x, w, EPS), expected, dtype)
    x = aligned.clone()
    pagedkern.rms_norm(x, w, EPS, out=x)  # in place
    assert_close_to(x, rms_norm64(aligned, w), dtype)
    x3 = torch.randn(4, 5, hidden, device="cuda").to(dtype)
    assert_close_to(pagedkern.rms_norm(x3, w, EPS), rms_norm64(x3, w), dtype)


def test_runs_on_the_callers_stream():
    # The side stream spins, then rewrites x; a kernel launched on any other stream would read
    # the old x. Ordering, not timing: on the caller's stream the result is always the new x's.
    x, w = inputs(512, 4096, torch.bfloat16, seed=9)
    new_x = torch.randn_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        x.copy_(new_x)
        out = pagedkern.rms_norm(x, w, EPS)
    stream.synchronize()
    assert_close_to(out, rms_norm64(new_x, w), torch.bfloat16)


def test_zero_rows_and_matches_reference_op():
    x, w = inputs(0, 64, torch.float16, seed=1)
    assert pagedkern.rms_norm(x, w).shape == (0, 64)
    x, w = inputs(17, 4096, torch.bfloat16, seed=2)
    err = (pagedkern.rms_norm(x, w).float() - pagedkern.reference.rms_norm(x, w).float()).abs()
    assert float(err.max()) <= 2**-6 * float(pagedkern.reference.rms_norm(x, w).abs().max())


def test_cupy_arrays_without_torch_tensors():
    cupy = pytest.importorskip("cupy")
    rng = cupy.random.default_rng(3)
    for dtype, tol in (("float16", REL_TOLERANCE[torch.float16]), ("float32", 1e-5)):
        x = (rng.standard_normal((33, 4096)) * 2).astype(dtype)
        w = rng.standard_normal(4096).astype(dtype)
        out = pagedkern.rms_norm(x, w, EPS)
        assert isinstance(out, cupy.ndarray)
        x64, w64 = x.astype("float64"), w.astype("float64")
        ref = x64 / cupy.sqrt((x64**2).mean(-1, keepdims=True) + EPS) * w64
        err = float(cupy.linalg.norm(out.astype("float64") - ref) / cupy.linalg.norm(ref))
        assert err <= tol
        residual = rng.standard_normal((33, 4096)).astype(dtype)
        expected = (x.astype("float32") + residual.astype("float32")).astype(dtype)
        pagedkern.fused_add_rms_norm(x, residual, w, EPS)
        assert bool((residual == expected).all())
