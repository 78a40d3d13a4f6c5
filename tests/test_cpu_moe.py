"""The CPU backend's fused_moe (ops/cpu/moe.py) tested as a kernel: against the reference
(reference/moe.py) over odd shapes (E not a power of two, top-k = E, one token, experts that
receive no token and one that receives all), every scoring, gpt-oss's biases and clamped
SwiGLU, half dtypes; every GEMM path (the fixed-order GEMM, torch._grouped_mm, the per-expert
loop), the loop's output block poisoned with NaN; NaN never passes (assert_close_to)."""

from __future__ import annotations

import pytest
import torch
from kernel_check import assert_close_to, poisoned

from pagedkern import ops, reference
from pagedkern.ops import cpu
from pagedkern.ops.cpu import dense_linear
from pagedkern.ops.cpu import moe as cpu_moe
from pagedkern.ops.variants import use_kernels


@pytest.fixture(params=["fixed_order", "grouped_mm", "loop"], autouse=True)
def gemm_path(request, monkeypatch):
    """Each test on every GEMM path (fp32: the fixed-order GEMM by default, torch's two under
    cpu_linear:blas); the loop's block starts as NaN."""
    if request.param == "fixed_order" and not dense_linear.fixed_order_runs():
        pytest.skip("pagedkern._cpu not built")
    if request.param == "grouped_mm" and not cpu_moe.grouped_mm_available():
        pytest.skip("this torch has no CPU torch._grouped_mm")
    monkeypatch.setattr(cpu_moe, "force_loop", request.param == "loop")
    monkeypatch.setattr(
        cpu_moe, "rows_buffer", lambda rows, cols, dtype: poisoned((rows, cols), dtype, "cpu")
    )
    with use_kernels(cpu_linear="fixed_order" if request.param == "fixed_order" else "blas"):
        yield request.param


def _operands(tokens, experts, hidden=32, inter=24, seed=0, dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g) * 2
    gu = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    biases = {}
    if bias:
        biases = dict(
            w_gate_up_bias=torch.randn(experts, 2 * inter, generator=g).to(dtype),
            w_down_bias=torch.randn(experts, hidden, generator=g).to(dtype),
        )
    return x, logits, gu, down, biases


def _want(x, logits, gu, down, top_k, biases, **options):
    """The reference in float64 (the weights as given, every operand widened)."""
    wide = {k: v.double() for k, v in biases.items()}
    return reference.fused_moe(x.double(), logits, gu.double(), down.double(), top_k,
                               **options, **wide)  # fmt: skip


SHAPES = [(7, 5, 2), (1, 3, 2), (13, 6, 6), (9, 7, 3), (1, 1, 1), (33, 12, 4), (40, 24, 8)]
SHAPE_IDS = ["E5k2", "one-token", "k=E", "E7k3", "E1", "E12k4", "E24k8"]


@pytest.mark.parametrize("tokens, experts, top_k", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(
    "scoring, renormalize",
    [("softmax", True), ("softmax", False), ("sigmoid", True), ("softmax_topk", False)],
)
def test_equals_the_reference_over_odd_shapes(tokens, experts, top_k, scoring, renormalize):
    x, logits, gu, down, _ = _operands(tokens, experts, seed=tokens * 31 + experts)
    got = cpu_moe.fused_moe(x, logits, gu, down, top_k, renormalize, "silu", scoring)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_close_to(got, _want(x, logits, gu, down, top_k, {}, renormalize=renormalize,
                                scoring=scoring), torch.float32)  # fmt: skip
    # without biases the GEMMs are the reference's own, group by group
    same = reference.fused_moe(x, logits, gu, down, top_k, renormalize, "silu", scoring)
    torch.testing.assert_close(got, same, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "clamped_swiglu"])
def test_activations_biases_and_dtypes(dtype, activation):
    # gpt-oss's case: biases, clamped SwiGLU (a small limit, so the clamps act), top-k softmax
    bias = activation == "clamped_swiglu"
    x, logits, gu, down, biases = _operands(11, 6, dtype=dtype, bias=bias, seed=5)
    options = dict(renormalize=False, activation=activation, scoring="softmax_topk",
                   swiglu_alpha=1.702, swiglu_limit=0.5)  # fmt: skip
    got = ops.fused_moe(x, logits, gu, down, 3, **options, **biases)
    assert got.dtype == dtype
    assert_close_to(got, _want(x, logits, gu, down, 3, biases, **options), dtype)


def test_experts_without_tokens_and_one_taking_all():
    x, logits, gu, down, _ = _operands(10, 6)
    logits = torch.full_like(logits, -5.0)
    logits[:, 4], logits[:, 1] = 5.0, 3.0  # every token: experts 4 then 1; 0, 2, 3, 5 none
    got = cpu_moe.fused_moe(x, logits, gu, down, 2)
    assert_close_to(got, _want(x, logits, gu, down, 2, {}), torch.float32)
    # top-1: expert 4's MLP itself, weight 1
    one = cpu_moe.fused_moe(x, logits, gu, down, 1)
    a = x @ gu[4].T
    inter = down.shape[-1]
    want = (torch.nn.functional.silu(a[:, :inter]) * a[:, inter:]) @ down[4].T
    torch.testing.assert_close(one, want)


def test_shapes_grouped_mm_refuses_run_the_loop(gemm_path):
    # H = 7, I = 5 (fp32 rows of 28 and 20 bytes): _grouped_mm's 16-byte stride rule fails
    x, logits, gu, down, _ = _operands(6, 5, hidden=7, inter=5)
    assert not cpu_moe.grouped_mm_fits(x, gu)
    got = cpu_moe.fused_moe(x, logits, gu, down, 2)
    assert_close_to(got, _want(x, logits, gu, down, 2, {}), torch.float32)
    if gemm_path == "grouped_mm":  # and the shapes it takes run it
        wide = _operands(6, 5)
        assert cpu_moe.grouped_mm_fits(wide[0], wide[2])


def test_non_contiguous_hidden_and_no_tokens():
    x, logits, gu, down, _ = _operands(8, 5)
    strided = torch.cat([x, x], dim=1)[:, ::2]  # every other column: [8, 32] of stride 2
    assert not strided.is_contiguous()
    got = ops.fused_moe(strided, logits, gu, down, 2)
    assert_close_to(got, _want(strided, logits, gu, down, 2, {}), torch.float32)
    empty = ops.fused_moe(x[:0], logits[:0], gu, down, 2)
    assert empty.shape == (0, x.shape[1])


def test_a_nan_in_one_token_stays_in_that_token():
    # the combine sums pairs by token: a NaN row poisons its own output row only
    x, logits, gu, down, _ = _operands(9, 7)
    x[3, 5] = float("nan")
    got = cpu_moe.fused_moe(x, logits, gu, down, 3)
    rows = torch.isnan(got).any(dim=1)
    assert rows.tolist() == [i == 3 for i in range(9)]
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to(got, torch.zeros_like(got), torch.float32)


def test_the_cpu_backend_runs_it_and_the_reference_backend_does_not(monkeypatch):
    assert cpu.IMPLEMENTATIONS["fused_moe"] is cpu_moe.fused_moe
    calls = []
    real = cpu_moe.fused_moe
    monkeypatch.setattr(cpu.implementations, "fused_moe", lambda *a: calls.append(1) or real(*a))
    x, logits, gu, down, _ = _operands(5, 4)
    with ops.use_backend("cpu"):
        fast = ops.fused_moe(x, logits, gu, down, 2)
    with ops.use_backend("reference"):
        slow = ops.fused_moe(x, logits, gu, down, 2)
    assert calls == [1]
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


def test_a_tokens_output_does_not_depend_on_its_batch(gemm_path, monkeypatch):
    if gemm_path != "fixed_order":
        pytest.skip("torch's GEMMs round a row apart with the rows around it")
    x, logits, gu, down, _ = _operands(33, 12)
    whole = cpu_moe.fused_moe(x, logits, gu, down, 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # another split of the work
    for i in (0, 7, 32):
        alone = cpu_moe.fused_moe(x[i : i + 1], logits[i : i + 1], gu, down, 4)
        assert torch.equal(alone[0], whole[i])
    assert torch.equal(cpu_moe.fused_moe(x[3:20], logits[3:20], gu, down, 4), whole[3:20])


def test_grouped_counts_are_checked():
    x, _, gu, _, _ = _operands(5, 4)
    with pytest.raises(ValueError, match="row counts summing"):
        dense_linear.dense_gemm_grouped(x, gu, torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="row counts summing"):
        dense_linear.dense_gemm_grouped(x, gu, torch.tensor([6, -1, 0, 0]))
    with pytest.raises(ValueError, match="contiguous"):
        dense_linear.dense_gemm_grouped(x, gu.transpose(1, 2), torch.tensor([5, 0, 0, 0]))
