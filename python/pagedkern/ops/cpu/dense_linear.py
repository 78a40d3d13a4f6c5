"""The CPU backend's GEMM of unquantized weights, x @ W.T (+ bias), by the `cpu_linear` kernel
variant (ops/variants.py):
- `fixed_order` (default): csrc/cpu/dense_gemm.cpp, fp32 x and W: every output 16 lanes of
  fused multiply-add chains over K and a fixed tree (dense_gemm.h), so a row's bits depend on
  its own x row only (never on M, the other rows, the threads or the ISA path). That is what
  keeps a request's tokens the same beside any batch and after a preemption (batch
  invariance). Against torch's GEMM on a Xeon: as fast for one row (both read the weights
  once), faster for 4-64 rows, ~0.77-0.9x its speed for hundreds of rows (0.6x at K = 8192)
  (bench/test_bench_cpu_dense_gemm.py).
- `blas`: torch's F.linear (oneDNN / MKL), whose bits depend on the rows in the product (its
  kernels for few rows differ from those for many, and its K blocking with them).
W may be fp32, bf16 or fp16 (a 16-bit checkpoint's projections on the CPU backend,
model/weight_assembly.py): each weight is widened to fp32 exactly before its fma, so the bits
are the fp32 copy's at half the weight bytes. bf16 / fp16 activations, and builds without the
C++ module, run F.linear (`blas_linear`: a 16-bit weight under fp32 x widened first). A MoE
layer's float experts take the same order (dense_gemm_grouped, from ops/cpu/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import variants
from . import quant_gemv

# The weights' dtypes the GEMM reads (its w_type numbers): 16-bit weights widen to fp32 exactly
# before their fma, so a bf16 / fp16 weight gives the bits of its fp32 copy at half the bytes.
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check_weight(t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims or t.dtype not in WEIGHT_TYPES or t.device.type != "cpu":
        raise ValueError(
            f"weight must be a {dims}-D float32, bfloat16 or float16 CPU tensor, got "
            f"{tuple(t.shape)} {t.dtype} on {t.device}"
        )


def _check_2d_fp32(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a 2-D float32 CPU tensor, got {tuple(t.shape)} {t.dtype} on {t.device}"
        )


def dense_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    path: str | None = None,
    threads: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 CPU -> x @ weight.T [M, N] float32, weight [N, K] float32, bfloat16 or
    float16 CPU (rows of unit stride both), in the fixed order (into `out` if given:
    contiguous [M, N] float32).
    path: one of quant_gemv.PATHS (default: the best this CPU runs; AVX-512 kernels on both
    avx512 paths, AVX2 on avx2 and avx_vnni, the std::fma loop on the others: the same bits);
    threads: default quant_gemv.threads_for(the multiply-adds)."""
    cpu_kernels = quant_gemv.cpu_module()
    _check_2d_fp32("x", x)
    _check_weight(weight, 2)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)}: K must equal weight {tuple(weight.shape)}'s")
    if path is not None and path not in quant_gemv.PATHS:
        raise ValueError(f"path must be one of {quant_gemv.PATHS}, got {path!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = quant_gemv.fp32_out(out, m, n)
    cpu_kernels.dense_gemm(
        y=out.data_ptr(), y_stride=n, x=x.data_ptr(), x_stride=x.stride(0),
        w=weight.data_ptr(), w_stride=weight.stride(0), m=m, n=n, k=k,
        threads=threads or quant_gemv.threads_for(m * n * k),
        path=-1 if path is None else cpu_kernels.PATHS[path], w_type=WEIGHT_TYPES[weight.dtype],
    )  # fmt: skip
    return out


def dense_gemm_grouped(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, threads: int | None = None
) -> torch.Tensor:
    """A MoE layer's expert GEMMs in the fixed order: x [P, K] float32 CPU, its rows grouped by
    expert (counts [E] int64: expert e's rows after those of the experts before it), times
    weight[e].T for the stacked weight [E, N, K] float32, bfloat16 or float16 CPU
    (contiguous) -> [P, N] float32; each expert's rows one dense_gemm."""
    cpu_kernels = quant_gemv.cpu_module()
    _check_2d_fp32("x", x)
    _check_weight(weight, 3)
    if not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} must be contiguous")
    experts, n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)}: K must equal weight {tuple(weight.shape)}'s")
    counts = counts.to(torch.int64).contiguous()
    if counts.shape != (experts,) or int(counts.sum()) != x.shape[0] or bool((counts < 0).any()):
        raise ValueError(
            f"counts {tuple(counts.shape)} must be {experts} non-negative row counts summing to "
            f"x's {x.shape[0]} rows"
        )
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    macs = x.shape[0] * n * k // max(1, int((counts > 0).sum()))
    cpu_kernels.dense_gemm_grouped(
        y=out.data_ptr(), x=x.data_ptr(), w=weight.data_ptr(), counts=counts.data_ptr(),
        experts=experts, n=n, k=k,
        threads=threads or quant_gemv.threads_for(macs),
        path=-1, w_type=WEIGHT_TYPES[weight.dtype],
    )  # fmt: skip
    return out


def fixed_order_runs() -> bool:
    """Whether fp32 GEMMs take the fixed order (cpu_linear:fixed_order and the module built)."""
    return variants.selected("cpu_linear") != "blas" and quant_gemv.available()


def _fixed_order(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype in WEIGHT_TYPES
        and x.dim() == 2
        and not x.requires_grad
    )


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] CPU @ weight.T (+ bias): the fixed-order GEMM for fp32 2-D x (and fp32 or
    16-bit weights: `cpu_linear:fixed_order`, the default, with the module built), else
    F.linear (a 16-bit weight under fp32 x widened first)."""
    return for_step()(x, weight, bias)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if not _fixed_order(x, weight):
        return blas_linear(x, weight, bias)
    out = dense_gemm(x, weight)
    return out if bias is None else out.add_(bias)


def blas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, a weight kept in 16 bits under wider activations widened first."""
    if weight.dtype != x.dtype and x.dtype == torch.float32:
        weight = weight.float()
    return F.linear(x, weight, bias)


def for_step():
    """dense_linear with the variant resolved once, for the calls of one forward step (the
    model's CPU-backend op table)."""
    return _linear if fixed_order_runs() else blas_linear
