"""The CPU backend's sampling: csrc/cpu/sampling.cpp (sampling.h has its design), a row's id in
a few passes over its logits, with min-p, top-k and top-p as thresholds instead of the
reference's sorts of the whole vocabulary (top-p 0.9 at V = 49152, one row: 8.5 ms there,
0.27 ms here, bench/test_bench_cpu_sampling.py). The semantics are reference/sampling.py's
and the draw the same Philox draw, so the ids are the reference's but where rounding moves a
boundary (the same distribution).

Logits processing (penalties, bias, masks) stays the reference's torch ops (it runs only for the
requests that ask for it); the logprob outputs are the C++ rows' too (log_softmax's values to
rounding, the same top-N ids). Variant `cpu_sample`: `kernel` (the
default where pagedkern._cpu is built) or `reference`."""

from __future__ import annotations

import torch

from ... import reference
from ...reference.logits_processing import process_logits
from ...reference.sampling import per_row
from .. import variants
from . import quant_gemv


def sample(
    logits: torch.Tensor,
    temperature,
    top_p,
    top_k,
    seeds,
    offsets=0,
    out: torch.Tensor | None = None,
    *,
    min_p=None,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs_out: torch.Tensor | None = None,
    **processing,
) -> torch.Tensor:
    """reference.sample's signature and semantics (its caller has checked the arguments:
    ops.sample, or the engine's runner, whose arrays are its own)."""
    if variants.selected("cpu_sample") != "kernel" or not quant_gemv.available():
        return reference.sample(
            logits, temperature, top_p, top_k, seeds, offsets, out, min_p=min_p,
            logprobs=logprobs, top_ids=top_ids, top_logprobs_out=top_logprobs_out, **processing,
        )  # fmt: skip
    rows, vocab = logits.shape
    x = logits  # (the kernel reads NaN as -inf itself)
    if any(value is not None for value in processing.values()) or logits.dtype != torch.float32:
        x = process_logits(logits, **processing)  # fp32, a new tensor
    if vocab > 1 and x.stride(1) != 1:
        x = x.contiguous()
    params = {
        "temperature": _row_array(temperature, rows, torch.float32),
        "top_p": _row_array(top_p, rows, torch.float32),
        "top_k": _row_array(top_k, rows, torch.int32, vocab),
        "min_p": torch.zeros(rows) if min_p is None else _row_array(min_p, rows, torch.float32),
        "seeds": _row_array(seeds, rows, torch.int64),
        "offsets": _row_array(offsets, rows, torch.int64),
    }
    ids = torch.empty(rows, dtype=torch.int32) if out is None else out
    top_n = 0 if top_ids is None else top_ids.shape[1]
    if rows:
        quant_gemv.cpu_module().sample(
            out=_output(ids, (rows,), torch.int32), logits=x.data_ptr(),
            logits_stride=x.stride(0), rows=rows, vocab=vocab, threads=torch.get_num_threads(),
            logprobs=0 if logprobs is None else _output(logprobs, (rows,), torch.float32),
            top_ids=_output(top_ids, (rows, top_n), torch.int32) if top_n else 0,
            top_logprobs=_output(top_logprobs_out, (rows, top_n), torch.float32) if top_n else 0,
            top_n=top_n, **{name: value.data_ptr() for name, value in params.items()},
        )  # fmt: skip
    return ids


def _row_array(value, rows: int, dtype: torch.dtype, vocab: int | None = None) -> torch.Tensor:
    """A per-row parameter as a contiguous [rows] `dtype` tensor (the engine's already is);
    top_k (given `vocab`) clamped into int32 first, since k <= 0 and k >= vocab are both off."""
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and value.shape == (rows,)
        and value.is_contiguous()
    ):
        return value
    if vocab is not None:
        return per_row(value, rows, torch.int64, torch.device("cpu")).clamp(-1, vocab).int()
    return per_row(value, rows, dtype, torch.device("cpu")).contiguous()


def _output(tensor: torch.Tensor, shape: tuple, dtype: torch.dtype) -> int:
    """The address of an output the kernel writes (its caller has checked it; a wrong one is
    refused here rather than written out of bounds)."""
    if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"an output {tuple(tensor.shape)} {tensor.dtype} must be contiguous "
                         f"{shape} {dtype}")  # fmt: skip
    return tensor.data_ptr()
