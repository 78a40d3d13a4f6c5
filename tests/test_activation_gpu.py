"""silu_and_mul kernel vs float64 math on the GPU: dtypes, odd and large shapes, strided and
misaligned rows (scalar path), CuPy."""

from __future__ import annotations

import pytest
import torch
from kernel_check import REL_TOLERANCE, assert_close_to, poisoned

import pagedkern

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (rows, d): 1 row, odd d (scalar path), model sizes, 8192 x 4096.
SHAPES = [(1, 11008), (7, 111), (3, 5), (5, 1536), (129, 14336), (8192, 4096)]


def silu_and_mul64(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x = x.double()
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", SHAPES)
def test_silu_and_mul(rows, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows * d)
    x = (torch.randn(rows, 2 * d, generator=g, device="cuda") * 4).to(dtype)
    out = poisoned((rows, d), dtype, "cuda")
    pagedkern.silu_and_mul(x, out=out)
    assert_close_to(out, silu_and_mul64(x), dtype)
    assert_close_to(pagedkern.silu_and_mul(x), silu_and_mul64(x), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_and_misaligned_rows(dtype):
    d = 2048
    base = torch.randn(33, 2 * d + 9, device="cuda").to(dtype)
    for x in (base[:, : 2 * d], base[:, 1 : 2 * d + 1]):  # odd stride; 2-byte offset
        assert_close_to(pagedkern.silu_and_mul(x), silu_and_mul64(x), dtype)
    x3 = torch.randn(2, 3, 2 * d, device="cuda").to(dtype)
    out = pagedkern.silu_and_mul(x3)
    assert out.shape == (2, 3, d)
    assert_close_to(out, silu_and_mul64(x3), dtype)


def test_cupy_arrays_without_torch_tensors():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.default_rng(1).standard_normal((17, 2 * 1536)).astype("float16")
    out = pagedkern.silu_and_mul(x)
    assert isinstance(out, cupy.ndarray) and out.shape == (17, 1536)
    x64 = x.astype("float64")
    ref = x64[:, :1536] / (1 + cupy.exp(-x64[:, :1536])) * x64[:, 1536:]
    err = float(cupy.linalg.norm(out.astype("float64") - ref) / cupy.linalg.norm(ref))
    assert err <= REL_TOLERANCE[torch.float16]
