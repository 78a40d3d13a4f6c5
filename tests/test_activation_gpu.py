"""The gated activation kernels (silu_and_mul, gelu_tanh_and_mul) vs float64 math on the GPU:
dtypes, odd and large shapes, strided and misaligned rows (scalar path), CuPy."""

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


def gelu_tanh_and_mul64(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x = x.double()
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


GATED = {
    "silu_and_mul": (pagedkern.silu_and_mul, silu_and_mul64),
    "gelu_tanh_and_mul": (pagedkern.gelu_tanh_and_mul, gelu_tanh_and_mul64),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", SHAPES)
@pytest.mark.parametrize("op", GATED)
def test_gated_activation(rows, d, dtype, op):
    kernel, exact = GATED[op]
    g = torch.Generator(device="cuda").manual_seed(rows * d)
    x = (torch.randn(rows, 2 * d, generator=g, device="cuda") * 4).to(dtype)
    out = poisoned((rows, d), dtype, "cuda")
    kernel(x, out=out)
    assert_close_to(out, exact(x), dtype)
    assert_close_to(kernel(x), exact(x), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", GATED)
def test_strided_and_misaligned_rows(dtype, op):
    kernel, exact = GATED[op]
    d = 2048
    base = torch.randn(33, 2 * d + 9, device="cuda").to(dtype)
    for x in (base[:, : 2 * d], base[:, 1 : 2 * d + 1]):  # odd stride; 2-byte offset
        assert_close_to(kernel(x), exact(x), dtype)
    x3 = torch.randn(2, 3, 2 * d, device="cuda").to(dtype)
    out = kernel(x3)
    assert out.shape == (2, 3, d)
    assert_close_to(out, exact(x3), dtype)


def test_cupy_arrays_without_torch_tensors():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.default_rng(1).standard_normal((17, 2 * 1536)).astype("float16")
    out = pagedkern.silu_and_mul(x)
    assert isinstance(out, cupy.ndarray) and out.shape == (17, 1536)
    x64 = x.astype("float64")
    ref = x64[:, :1536] / (1 + cupy.exp(-x64[:, :1536])) * x64[:, 1536:]
    err = float(cupy.linalg.norm(out.astype("float64") - ref) / cupy.linalg.norm(ref))
    assert err <= REL_TOLERANCE[torch.float16]
