"""The CPU backend's fused_moe: the reference's routing and grouping (reference/moe.py), then
every expert's two GEMMs in one call each and the activation, bias, weighting and combine once
over all the routed rows, so no Python runs per expert.

Why. The reference loops over the experts that received tokens, about ten torch calls each
(slice, GEMM, cast, activation, cast, GEMM, cast, weight, index_add). A Qwen3-MoE-shaped decode
step at batch 16 routes 128 pairs to ~89 of 128 experts: ~900 small calls a layer, each an
OpenMP region that on a loaded host costs far more than its arithmetic (end to end the loop
ran at 0.82x of this path on a quiet host, 0.26-0.38x under load:
bench/results/2026-12-05-xeon-moe-cpu.md).

Design. The (token, slot) pairs sorted by expert (one stable sort) are rows of one [P, H] block;
expert e owns rows [offs[e-1], offs[e]). fp32 experts run the fixed-order GEMM (one C++ call
over the experts, csrc/cpu/dense_gemm.cpp: batch invariant, as the dense layers). Otherwise
(`cpu_linear:blas`, half dtypes) each GEMM is torch._grouped_mm over that block against
the stacked weights ([E, N, K] read as [E, K, N]: a view, no copy), which runs one GEMM per group
in C++ (bit for bit torch.mm's per group, empty groups skipped). Where torch has no CPU
_grouped_mm, or the weights' rows are not unit-stride, a loop of torch.mm into the same block
does it (still one call per expert, not ten; it also takes the shapes whose strides
_grouped_mm refuses, not multiples of 16 bytes). Biases are gathered per row and added after the
GEMM (gpt-oss), the activation runs once on [P, 2I] in fp32 rounded once to hidden's dtype as
the reference's, the routing weights multiply [P, H] in fp32 and index_add sums the pairs into
their tokens. Without biases the GEMMs' results are the reference's bit for bit; a bias is added
after its GEMM's rounding rather than inside addmm (fp32: an ulp; bf16/fp16: one more rounding,
within the kernel tolerance).
"""

from __future__ import annotations

import functools

import torch

from ...reference.moe import GATED_ACTIVATIONS, gated, group_by_expert, moe_route
from . import dense_linear


@functools.cache
def grouped_mm_available() -> bool:
    """Whether this torch runs torch._grouped_mm on CPU tensors (float32, the weights a
    transposed view), checked once on a tiny call against torch.mm."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.arange(12.0).reshape(3, 4)  # (rows of 16 bytes: its stride rule)
        b = torch.arange(32.0).reshape(2, 4, 4)
        offs = torch.tensor([1, 3], dtype=torch.int32)
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
        want = torch.cat([a[:1] @ b[0].T, a[1:] @ b[1].T])
        return bool(torch.equal(got, want))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def rows_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The per-expert loop's output block (uninitialised: every row is written; tests poison
    it with NaN to prove that)."""
    return torch.empty(rows, cols, dtype=dtype)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x [P, K] against weight [E, N, K] read as [E, K, N]: a
    torch that has it on the CPU, unit-stride weight rows, and every other stride of x, the
    weight and the [P, N] result a multiple of 16 bytes (its rule; data pointers may be
    anywhere). `force_loop` (tests) says no."""
    size = x.element_size()
    strides = (x.stride(0), weight.stride(0), weight.stride(1), weight.shape[1])
    return (
        not force_loop
        and x.stride(1) == 1
        and weight.stride(2) == 1
        and all(s * size % 16 == 0 for s in strides)
        and grouped_mm_available()
    )


force_loop = False  # tests: run the per-expert loop where _grouped_mm would run


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[P, N] in x's dtype: x [P, K]'s rows of expert e (the counts[e] after those of the
    experts before it) times weight[e].T, for the stacked weight [E, N, K]: one
    torch._grouped_mm call where it fits, else a loop of torch.mm over the experts with rows
    (the same bits); fp32 under cpu_linear:fixed_order (the default), the fixed-order GEMM
    per expert (dense_linear.dense_gemm_grouped: a row's bits never depend on the batch)."""
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and dense_linear.fixed_order_runs()
    ):
        return dense_linear.dense_gemm_grouped(x, weight, counts)
    if grouped_mm_fits(x, weight):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
    out = rows_buffer(x.shape[0], weight.shape[1], x.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):  # (a host read: the loop needs the counts)
        if n:
            torch.mm(x[start : start + n], weight[e].T, out=out[start : start + n])
            start += n
    return out


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
    scoring: str = "softmax",
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """reference.fused_moe's function and signature (arguments validated by ops.fused_moe):
    [T, H] in hidden's dtype."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
    tokens, num_experts = hidden.shape[0], w_gate_up.shape[0]
    if tokens == 0:
        return hidden.new_zeros(hidden.shape)
    weights, ids = moe_route(router_logits, top_k, renormalize, scoring)
    order, counts = group_by_expert(ids, num_experts)
    token_of = order // top_k
    x = hidden[token_of]  # [P, H], grouped by expert (a fresh contiguous copy)
    expert_of = None
    if w_gate_up_bias is not None or w_down_bias is not None:
        expert_of = ids.reshape(-1)[order]  # each sorted row's expert
    gate_up = grouped_linear(x, w_gate_up, counts)
    if w_gate_up_bias is not None:
        gate_up += w_gate_up_bias[expert_of]
    h = gated(activation, gate_up.float(), swiglu_alpha, swiglu_limit).to(hidden.dtype)
    y = grouped_linear(h, w_down, counts)
    if w_down_bias is not None:
        y += w_down_bias[expert_of]
    y = y.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32)
    out.index_add_(0, token_of, y)
    return out.to(hidden.dtype)
