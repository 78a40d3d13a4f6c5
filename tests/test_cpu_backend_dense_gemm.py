"""The CPU backend's fixed-order fp32 GEMM (csrc/cpu/dense_gemm.cpp through
ops/cpu/dense_linear.py), the GEMM of unquantized weights: against the float64 reference on
fresh random inputs and odd shapes with the output poisoned; bit for bit against a model of its
order (csrc/cpu/dense_gemm.h: 16 lanes of fma chains over K, a halving tree); the same bits on
every ISA path, for any M, row, thread count or stride; and the engine's layers, LM head and
backend choice calling it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_check import assert_close_to, poisoned

from pagedkern import ops
from pagedkern.model.linear import LogitsProjection, linear
from pagedkern.ops.cpu import dense_linear, quant_gemv
from pagedkern.ops.variants import use_kernels

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

SHAPES = [(1, 1, 1), (1, 37, 64), (3, 50, 17), (5, 33, 200), (13, 100, 577), (64, 7, 31)]


def _paths() -> list[str]:
    return quant_gemv.supported_paths() if quant_gemv.available() else []


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


def _model_of_the_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dense_gemm.h's order in torch: lane l's fma chain over k = l, l + 16, ... (each fma the
    exact product plus the accumulator, rounded once to float64 then to float32: a double
    rounding that differs from fma's single one in ~2^-29 of cases), then the halving tree."""
    m, k = x.shape
    pad = -k % 16
    xs = F.pad(x, (0, pad)).double().view(m, 1, -1, 16)
    ws = F.pad(w, (0, pad)).double().view(1, w.shape[0], -1, 16)
    acc = torch.zeros(m, w.shape[0], 16, dtype=torch.float32)
    for step in range(xs.shape[2]):
        acc = (xs[:, :, step] * ws[:, :, step] + acc.double()).float()
    width = 8
    while width:
        acc = acc[..., :width] + acc[..., width : 2 * width]
        width //= 2
    return acc[..., 0]


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_the_reference(path, m, n, k):
    x, w = _inputs(m, n, k, seed=m * 7 + n + k)
    out = poisoned((m, n), torch.float32, "cpu")
    got = dense_linear.dense_gemm(x, w, path=path, out=out)
    assert got is out
    assert_close_to(got, x.double() @ w.double().T, torch.float32)


# (9, 20, 4200): more than one row group, so K runs in blocks (2048) whose lanes are stored
@pytest.mark.parametrize(
    "m,n,k", [(1, 9, 5), (6, 13, 16), (7, 25, 100), (2, 40, 33), (9, 20, 4200)]
)
def test_its_bits_are_the_order_it_documents(m, n, k):
    x, w = _inputs(m, n, k, seed=k)
    want = _model_of_the_order(x, w)
    for path in _paths():
        assert torch.equal(dense_linear.dense_gemm(x, w, path=path), want), path


def test_every_path_gives_the_same_bits():
    x, w = _inputs(11, 70, 300, seed=3)
    outs = {p: dense_linear.dense_gemm(x, w, path=p) for p in _paths()}
    first = outs[_paths()[0]]
    for path, out in outs.items():
        assert torch.equal(out, first), path


@pytest.mark.parametrize("path", _paths())
def test_a_row_does_not_depend_on_its_batch_the_threads_or_strides(path):
    x, w = _inputs(23, 101, 260, seed=5)
    whole = dense_linear.dense_gemm(x, w, path=path, threads=1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the GEMM's threads are torch's OpenMP team
        for i in range(23):
            alone = dense_linear.dense_gemm(x[i : i + 1], w, path=path, threads=2)
            assert torch.equal(alone[0], whole[i])
        for lo, hi in [(2, 7), (0, 4), (5, 22)]:
            got = dense_linear.dense_gemm(x[lo:hi], w, path=path, threads=3)
            assert torch.equal(got, whole[lo:hi])
        part = dense_linear.dense_gemm(x, w[13:77], path=path, threads=2)  # other W tiles
        assert torch.equal(part, whole[:, 13:77])
    finally:
        torch.set_num_threads(previous)
    wide = torch.zeros(23, 300)
    wide[:, 8:268] = x  # rows of stride 300, unit stride along K
    wider = torch.zeros(101, 280)
    wider[:, 3:263] = w
    assert torch.equal(dense_linear.dense_gemm(wide[:, 8:268], wider[:, 3:263], path=path), whole)


def test_blocks_of_k_keep_a_rows_bits():
    # one row runs K whole, 70 rows in blocks of 2048 (x blocks of 32, 32 and 6 rows)
    x, w = _inputs(70, 30, 4500, seed=11)
    whole = dense_linear.dense_gemm(x, w)
    for i in (0, 5, 31, 32, 64, 69):
        assert torch.equal(dense_linear.dense_gemm(x[i : i + 1], w)[0], whole[i])


def test_k_zero_gives_zeros():
    out = dense_linear.dense_gemm(
        torch.empty(3, 0), torch.empty(5, 0), out=poisoned((3, 5), torch.float32, "cpu")
    )
    assert torch.equal(out, torch.zeros(3, 5))


def test_nan_in_a_row_reaches_its_outputs_only():
    x, w = _inputs(6, 40, 70, seed=9)
    x[2, 33] = float("nan")
    out = dense_linear.dense_gemm(x, w)
    assert torch.isnan(out[2]).all()
    assert not torch.isnan(out[[0, 1, 3, 4, 5]]).any()


# (1, 37, 4200): one row; (9, 20, 4200): row groups and K blocks, widened in the tiles;
# (130, 70, 300) and (129, 9, 2100): the widened blocks of 128 rows or more
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 9, 5), (1, 37, 4200), (4, 13, 16), (7, 25, 100), (9, 20, 4200), (130, 70, 300),
     (129, 9, 2100)],
)  # fmt: skip
def test_16_bit_weights_give_the_bits_of_their_fp32_copy(dtype, m, n, k):
    """A bf16 / fp16 checkpoint's weights kept at half the bytes: each widened exactly to fp32
    before its fma, so the same bits as the GEMM of the fp32 copy, on every path."""
    x, w = _inputs(m, n, k, seed=m + k)
    w16 = w.to(dtype)
    if dtype == torch.float16:  # the fp16 values whose widening is not a shift
        specials = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -0.0, 2.0**-24, 3.05e-5, -1.0])
        w16.view(-1)[: min(8, w16.numel())] = specials[: min(8, w16.numel())].to(dtype)
    want = dense_linear.dense_gemm(x, w16.float())
    for path in _paths():
        out = poisoned((m, n), torch.float32, "cpu")
        assert torch.equal(dense_linear.dense_gemm(x, w16, path=path, out=out), want), path
    assert torch.equal(dense_linear.dense_linear(x, w16), want)


def test_16_bit_expert_weights_give_the_bits_of_their_fp32_copy():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(11, 300, generator=g), torch.randn(3, 40, 300, generator=g)
    counts = torch.tensor([4, 0, 7])
    want = dense_linear.dense_gemm_grouped(x, w.bfloat16().float(), counts)
    assert torch.equal(dense_linear.dense_gemm_grouped(x, w.bfloat16(), counts), want)


def test_the_blas_variant_widens_16_bit_weights_for_fp32_activations():
    x, w = _inputs(3, 8, 40, seed=1)
    with use_kernels(cpu_linear="blas"):
        got = dense_linear.dense_linear(x, w.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w.bfloat16().float()))


def test_arguments_are_checked():
    x, w = _inputs(2, 8, 16, seed=0)
    with pytest.raises(ValueError, match="x must be a 2-D float32"):
        dense_linear.dense_gemm(x.double(), w)
    with pytest.raises(ValueError, match="weight must be a 2-D float32, bfloat16 or float16"):
        dense_linear.dense_gemm(x, w[None])
    with pytest.raises(ValueError, match=r"weight must be .* torch.float64"):
        dense_linear.dense_gemm(x, w.double())
    with pytest.raises(ValueError, match="K must equal"):
        dense_linear.dense_gemm(x, w[:, :15])
    with pytest.raises(ValueError, match="path must be one of"):
        dense_linear.dense_gemm(x, w, path="sse9")
    with pytest.raises(ValueError, match="must be contiguous"):
        dense_linear.dense_gemm(x, w, out=torch.empty(8, 2).T)
    missing = [p for p in quant_gemv.PATHS if p not in _paths()]
    if missing:
        with pytest.raises(RuntimeError, match=missing[0]):
            dense_linear.dense_gemm(x, w, path=missing[0])


def test_the_cpu_backend_runs_it_for_float_weights_and_the_reference_does_not(monkeypatch):
    x, w = _inputs(3, 24, 40, seed=1)
    bias = torch.randn(24)
    calls = []
    real = dense_linear.dense_gemm
    monkeypatch.setattr(
        dense_linear, "dense_gemm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    for backend in ("cpu", "auto"):
        with ops.use_backend(backend):
            got = linear(x, w, bias)
        assert torch.equal(got, real(x, w) + bias)
    assert len(calls) == 2
    with ops.use_backend("reference"):
        assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))
    with ops.use_backend("cpu"), use_kernels(cpu_linear="blas"):
        assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))
        assert torch.equal(dense_linear.for_step()(x, w, bias), F.linear(x, w, bias))
    with ops.use_backend("cpu"):  # bf16 activations: torch's GEMM
        half = linear(x.bfloat16(), w.bfloat16())
        assert torch.equal(half, F.linear(x.bfloat16(), w.bfloat16()))
    assert len(calls) == 2


def test_the_lm_head_runs_it_on_the_cpu_backend():
    hidden, head = _inputs(4, 300, 64, seed=2)
    project = LogitsProjection()
    with ops.use_backend("cpu"):
        assert torch.equal(project(hidden, head), dense_linear.dense_gemm(hidden, head))
        # bf16 hidden states meet an fp32 copy of the head
        got = project(hidden.bfloat16(), head.bfloat16())
        want = dense_linear.dense_gemm(hidden.bfloat16().float(), head.bfloat16().float())
        assert torch.equal(got, want)
    with ops.use_backend("reference"):
        assert torch.equal(project(hidden, head), F.linear(hidden, head))
