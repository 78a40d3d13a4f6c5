"""rejection_sample (speculative verification): validation, then csrc/rejection_sampling.cu or
the reference (pagedkern.reference.rejection_sampling: layout, Philox words and semantics)."""

from __future__ import annotations

import sys

from . import support
from .arrays import (
    ArrayView,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_shape,
    common_device,
    empty_like,
    view,
)
from .launch import check_indices, kernel_or_reference, launch_context, reference_on_torch

PROB_DTYPES = ("float32", "float64")  # the kernel covers float32 (ops/support.py)


def rejection_sample(
    target_probs,
    draft_token_ids,
    draft_probs,
    cu_draft,
    seeds,
    offsets,
    *,
    out_token_ids=None,
    out_num_tokens=None,
    stream=None,
):
    """(out_token_ids int32 [B, max k + 1], out_num_tokens int32 [B]) for B requests, request b
    having proposed k_b = cu_draft[b + 1] - cu_draft[b] tokens: target_probs float [D + B, V],
    draft_token_ids int32 [D], draft_probs float [D, V] (same dtype as target_probs) or None
    (point mass: n-gram proposals), cu_draft int32 [B + 1], seeds and offsets int64 [B].

    out_token_ids int32 [B, C] (C >= max k + 1) and out_num_tokens int32 [B], both or neither:
    given, the kernel path reads nothing back to the host (CUDA-graph capturable) and checks
    cu_draft on the device (PAGEDKERN_CHECK_INDICES=1 traps; otherwise an inconsistent request
    gets a row of -1 and 0 tokens, a draft id outside the vocabulary is rejected unread). Not
    given, cu_draft is read back once to size the outputs and its entries are checked there."""
    tv = view(target_probs, "target_probs")
    check_dtype(tv, PROB_DTYPES)
    check_ndim(tv, 2)
    _check_rows(tv)
    rows, vocab = tv.shape
    if vocab == 0:
        raise ValueError(f"{tv.describe()}: the vocabulary is empty")
    cv = _checked(cu_draft, "cu_draft", "int32", (None,))
    if cv.shape[0] == 0:
        raise ValueError(f"{cv.describe()} must have B + 1 >= 1 entries")
    batch = cv.shape[0] - 1
    iv = _checked(draft_token_ids, "draft_token_ids", "int32", (None,))
    num_draft = iv.shape[0]
    if rows != num_draft + batch:
        raise ValueError(
            f"{tv.describe()} must have D + B = {num_draft} + {batch} = {num_draft + batch} rows "
            f"(draft_token_ids has D = {num_draft}, cu_draft has B + 1 = {batch + 1} entries)"
        )
    views = [tv, cv, iv]
    qv = None
    if draft_probs is not None:
        qv = view(draft_probs, "draft_probs")
        check_dtype(qv, (tv.dtype,))
        check_shape(qv, (num_draft, vocab))
        _check_rows(qv)
        views.append(qv)
    sv = _checked(seeds, "seeds", "int64", (batch,))
    ov = _checked(offsets, "offsets", "int64", (batch,))
    views += [sv, ov]
    if (out_token_ids is None) != (out_num_tokens is None):
        raise ValueError("give out_token_ids and out_num_tokens together")
    out_cols = None
    if out_token_ids is not None:
        otv = _checked(out_token_ids, "out_token_ids", "int32", (batch, None))
        onv = _checked(out_num_tokens, "out_num_tokens", "int32", (batch,))
        out_cols = otv.shape[1]
        if out_cols == 0:
            raise ValueError(f"{otv.describe()} needs max k + 1 >= 1 columns")
        views += [otv, onv]
    common_device(views)

    if not kernel_or_reference(
        "rejection_sample", views, support.rejection_sample(tv.dtype, vocab)
    ):
        reference = reference_on_torch("rejection_sample", views)
        check_draft_contents(cu_draft, draft_token_ids, vocab, out_cols)
        tokens, num = reference.rejection_sample(
            target_probs, draft_token_ids, draft_probs, cu_draft, seeds, offsets
        )
        device = target_probs.device
        if out_token_ids is None:
            return tokens.to(device), num.to(device)
        out_token_ids.fill_(-1)
        out_token_ids[:, : tokens.shape[1]].copy_(tokens)
        out_num_tokens.copy_(num)
        return out_token_ids, out_num_tokens

    if out_token_ids is None:  # one read-back: the output width is max k + 1
        cu = _host_list(cv)
        _check_cu_draft(cu, num_draft, None)
        out_cols = 1 + max((cu[b + 1] - cu[b] for b in range(batch)), default=0)
        out_token_ids = empty_like(tv, (batch, out_cols), "int32", name="out_token_ids")
        out_num_tokens = empty_like(tv, (batch,), "int32", name="out_num_tokens")
        otv, onv = view(out_token_ids, "out_token_ids"), view(out_num_tokens, "out_num_tokens")
    if batch == 0:
        return out_token_ids, out_num_tokens
    module, device, handle = launch_context(views, stream)
    module.rejection_sample(
        out_token_ids=otv.ptr,
        out_num_tokens=onv.ptr,
        target_probs=tv.ptr,
        draft_probs=0 if qv is None else qv.ptr,
        draft_token_ids=iv.ptr,
        cu_draft=cv.ptr,
        seeds=sv.ptr,
        offsets=ov.ptr,
        batch=batch,
        vocab=vocab,
        num_draft=num_draft,
        out_cols=out_cols,
        target_stride=_row_stride(tv),
        draft_stride=0 if qv is None else _row_stride(qv),
        check_indices=check_indices(),
        device=device,
        stream=handle,
    )
    return out_token_ids, out_num_tokens


def check_draft_contents(cu_draft, draft_token_ids, vocab: int, out_cols: int | None) -> None:
    """cu_draft rises from 0 to D, max k + 1 fits out_cols (when given), every draft id is in
    [0, vocab): the values the reference follows (torch tensors, read on the host)."""
    cu = [int(c) for c in cu_draft.tolist()]
    _check_cu_draft(cu, int(draft_token_ids.shape[0]), out_cols)
    ids = draft_token_ids.long()
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"draft_token_ids[{i}] = {int(ids[i])} is outside the vocabulary [0, {vocab})"
        )


def _check_cu_draft(cu: list[int], num_draft: int, out_cols: int | None) -> None:
    if cu[0] != 0:
        raise ValueError(f"cu_draft[0] = {cu[0]} must be 0")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            raise ValueError(
                f"cu_draft must not decrease: cu_draft[{b + 1}] = {cu[b + 1]} < "
                f"cu_draft[{b}] = {cu[b]}"
            )
        if out_cols is not None and cu[b + 1] - cu[b] + 1 > out_cols:
            raise ValueError(
                f"request {b} proposed {cu[b + 1] - cu[b]} tokens: out_token_ids needs "
                f"{cu[b + 1] - cu[b] + 1} columns, has {out_cols}"
            )
    if cu[-1] != num_draft:
        raise ValueError(
            f"cu_draft[-1] = {cu[-1]} must equal the number of draft tokens D = {num_draft}"
        )


def _checked(value, name: str, dtype: str, shape) -> ArrayView:
    av = view(value, name)
    check_dtype(av, (dtype,))
    check_shape(av, shape)
    check_contiguous(av)
    return av


def _check_rows(a: ArrayView) -> None:
    if a.shape[1] > 1 and a.strides[1] != 1:
        raise ValueError(f"{a.describe()}: rows must be contiguous, got strides {a.strides}")


def _row_stride(a: ArrayView) -> int:
    return a.strides[0] if a.shape[0] > 1 else a.shape[1]


def _host_list(a: ArrayView) -> list[int]:
    if _capturing(a):  # a read-back would fail the capture, or capture a stale value
        raise ValueError(
            f"{a.describe()} cannot be read back during CUDA graph capture: pass "
            "out_token_ids= and out_num_tokens= (sized max k + 1) to capture rejection_sample"
        )
    if a.library == "torch":
        return [int(c) for c in a.obj.tolist()]
    if a.library == "cupy":
        return [int(c) for c in a.obj.get().tolist()]
    raise TypeError(
        f"{a.describe()} is a plain __cuda_array_interface__ object: pass out_token_ids= and "
        "out_num_tokens= (the output width max k + 1 cannot be read from it)"
    )


def _capturing(a: ArrayView) -> bool:
    """Whether the stream the caller's library launches on is capturing a CUDA graph."""
    library = sys.modules.get(a.library)
    if a.library == "torch" and library is not None:
        cuda = library.cuda
        return cuda.is_available() and bool(cuda.is_current_stream_capturing())
    if a.library == "cupy" and library is not None:
        return bool(library.cuda.get_current_stream().is_capturing())
    return False
