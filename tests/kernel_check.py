"""How every kernel test compares: outputs poisoned with NaN before the call, then the relative
error ||out - ref|| / ||ref|| against a float64 reference, per-dtype bounds."""

from __future__ import annotations

import torch

from pagedkern.reference.quantized_weight import QuantizedWeight

# bf16 keeps 8 mantissa bits, fp16 11: one rounding of the output dominates these errors.
REL_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp(min=1e-30))


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "output holds NaN (poison survived or kernel produced it)"
    err = relative_error(out, ref)
    assert err <= REL_TOLERANCE[dtype], f"relative error {err:.3g} > {REL_TOLERANCE[dtype]}"


def assert_same_e4m3(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical E4M3 bytes, except that a NaN may carry either sign (fp8.cuh)."""
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan = (w & 0x7F) == 0x7F
    assert torch.equal((g & 0x7F) == 0x7F, nan), "NaN positions differ"
    mismatch = (g != w) & ~nan
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} bytes differ, e.g. got {g[mismatch][:8].tolist()} "
        f"want {w[mismatch][:8].tolist()}"
    )


def every_variant(op: str, skip: tuple[str, ...] = ()):
    """An autouse fixture running each test of a module once per kernel variant of `op`
    (pagedkern.ops.variants.VARIANTS) but those in `skip` (variants that run the same kernels
    as another for every call of the module), selected through the `kernels` fixture."""
    import pytest

    from pagedkern.ops.variants import VARIANTS

    names = [name for name in VARIANTS[op].names if name not in skip]

    @pytest.fixture(params=names, autouse=True, ids=lambda name: f"{op}-{name}")
    def kernel_variant(request, kernels):
        kernels(**{op: request.param})
        return request.param

    return kernel_variant


def cpu_gemv_into_poisoned(module, code: int, tiles, x, n: int, path: str, bits: int, pad: int):
    """pagedkern._cpu's gemv over packed `tiles` (format `code`) into rows of N + pad poisoned
    columns; asserts the columns past N stay NaN and returns the [M, N] part."""
    m, k = x.shape
    y = poisoned((m, n + pad), torch.float32, "cpu")
    module.gemv(
        format=code, y=y.data_ptr(), y_stride=n + pad, x=x.data_ptr(), x_stride=k,
        packed=tiles.data_ptr(), scales=0, m=m, n=n, k=k, threads=2,
        path=module.PATHS[path], activation_bits=bits,
    )  # fmt: skip
    assert y[:, n:].isnan().all(), "a row past N was written"
    return y[:, :n]


def assert_quant_gemv_picks(weight, fmt: str, tiles, x, want, path: str, bits: int) -> None:
    """ops.cpu.quant_gemv on `weight` packs exactly `tiles` (format `fmt`) and returns `want`
    bit for bit, into a poisoned out; and it lies near the float64 reference (a loose check
    that neither is wrong)."""
    from pagedkern.ops.cpu import quant_gemv
    from pagedkern.reference.quant_gemm import quant_linear

    out = poisoned((x.shape[0], weight.shape[0]), torch.float32, "cpu")
    got = quant_gemv.quant_gemv(x, weight, path=path, out=out, activation_bits=bits)
    assert quant_gemv.tile_format(weight) == fmt
    assert torch.equal(quant_gemv.packed(weight), tiles) and torch.equal(got, want)
    exact = quant_linear(x.double(), weight)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-2


def six_bit_weight(n: int, k: int, seed: int) -> QuantizedWeight:
    """Q6_K's shape: codes -32..31 (both ends present), fp32 scales per 16 (d * sc: an fp16 d
    per 256 times an int8), one row's scales all zero: the CPU GEMM's int6_k tiles where K is a
    multiple of 256, int6_g16 where not."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    q[0, 0], q[-1, -1] = -32, 31
    d = (torch.rand(n, (k + 255) // 256, generator=g) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (n, k // 16), generator=g).float()
    scales = d.repeat_interleave(16, dim=1)[:, : k // 16] * sc
    scales[n // 2] = 0
    return QuantizedWeight("int8", (n, k), q, scales, None, 16)
