"""sample: validation, per-row parameters as device arrays, then csrc/sampling.cu or the
reference; v4's split plan (how many CTAs share a row)."""

from __future__ import annotations

from . import support
from .arrays import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    ITEMSIZE,
    ArrayView,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_shape,
    common_device,
    empty_like,
    full_like,
    view,
)
from .index_checks import check_sampling_indices
from .launch import (
    check_indices,
    kernel_or_reference,
    kernel_variant,
    launch_context,
    on_launch_stream,
    reference_on_torch,
    sm_count,
)

_PARAMS = (
    ("temperature", "float32"),
    ("top_p", "float32"),
    ("top_k", "int32"),
    ("seeds", "int64"),
    ("offsets", "int64"),
)
# The logits-processing inputs (pagedkern.reference.logits_processing): name, dtypes, shape
# given rows B, vocab V and nnz (the token_ids length); None = any size.
_PROCESSING = (
    ("token_offsets", "int32", lambda b, v, n: (b + 1,)),
    ("token_ids", "int32", lambda b, v, n: (n,)),
    ("token_counts", "int32", lambda b, v, n: (n,)),
    ("token_bias", "float32", lambda b, v, n: (n,)),
    ("presence_penalty", "float32", lambda b, v, n: (b,)),
    ("frequency_penalty", "float32", lambda b, v, n: (b,)),
    ("repetition_penalty", "float32", lambda b, v, n: (b,)),
    ("bitmask", "int32", lambda b, v, n: (None, (v + 31) // 32)),
    ("bitmask_rows", "int32", lambda b, v, n: (b,)),
    ("min_p", "float32", lambda b, v, n: (b,)),
)
_SPARSE = ("token_offsets", "token_ids", "token_counts", "token_bias")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
MAX_TOP_LOGPROBS = 20
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_THREADS = 512  # threads per CTA of the sampling kernels (csrc/sampling_common.cuh kThreads)
MAX_SLICES = 256  # CTAs per row at most (csrc/sampling.cu accepts up to 4096)


AUTO, V3, V2, V4 = -1, 0, 1, 2  # variants.VARIANTS["sample"] codes


def measured_variant(processing: bool, logprob_outputs: bool) -> int:
    """sample:auto (the default variant): the kernel that measured fastest on the first H200
    run (bench/results/2026-12-04-h200.md, B=1..128, V=128256): plain sampling ran fastest on v2
    at every batch size (top-p: 200-256 us against v4's 219-727), a call with logits
    processing on v3's fused kernel (1195 us against v2's 3136); v4 is v3 with its split for
    small batches. Logprob outputs take v3's kernel too (v2's top-N are torch ops)."""
    return V4 if processing or logprob_outputs else V2


def split_slices(rows: int, vocab: int, itemsize: int, num_sms: int) -> int:
    """v4's CTAs per row: as many as fit one wave (rows x slices <= the SM count: the kernels
    are __launch_bounds__(512, 1), a second wave would double a pass), each slice at least one
    16-byte load per thread (512 x 16 bytes: a pass over fewer elements costs the same latency
    and adds merge work), at most MAX_SLICES. 1 (v3's one CTA per row) when the rows fill the
    GPU or the row is too short to share."""
    if rows <= 0:
        return 1
    min_slice = _THREADS * (16 // itemsize)
    return max(1, min(num_sms // rows, vocab // min_slice, MAX_SLICES))


def split_state_words(slices: int) -> int:
    """int64 words of v4's merge state per row (csrc/sampling.h sample_split_state_words; the
    kernel refuses a smaller stride)."""
    return 16 + 4 * 256 + 3 * slices


def sample(
    logits,
    temperature,
    top_p,
    top_k,
    seeds,
    offsets=0,
    out=None,
    *,
    token_offsets=None,
    token_ids=None,
    token_counts=None,
    token_bias=None,
    presence_penalty=None,
    frequency_penalty=None,
    repetition_penalty=None,
    bitmask=None,
    bitmask_rows=None,
    min_p=None,
    logprobs=None,
    top_ids=None,
    top_logprobs=None,
    stream=None,
):
    """One token id per row of logits [B, V] (int32 [B]). Per-row parameters, as [B] arrays or
    Python numbers: temperature float32 (<= 0: greedy), top_p float32 (>= 1: off), top_k int32
    (<= 0: off), seeds int64, offsets int64. Semantics: pagedkern.reference.sampling; the CUDA
    kernel draws from exactly that distribution (not necessarily the same ids).

    Logits processing (optional arrays, reference.logits_processing has the semantics): the
    sparse entries token_offsets int32 [B + 1], token_ids / token_counts int32 [nnz],
    token_bias float32 [nnz] (all four together, with the three penalties float32 [B]);
    bitmask int32 [M, ceil(V / 32)] with bitmask_rows int32 [B]; min_p float32 [B]. Off the
    kernels their indices are checked (index_checks.check_sampling_indices).
    Outputs (optional): logprobs float32 [B] (the sampled token's), top_ids int32 [B, N] and
    top_logprobs float32 [B, N], N <= min(20, V) (0: none), both or neither. The kernel variant
    (PAGEDKERN_KERNELS=sample:...): auto (the default) takes the one that measured fastest for
    the call (measured_variant); v3 computes everything in one kernel, v4 is v3
    with a row split over several CTAs when the rows are fewer than the SMs (split_slices; a
    call asking for logprobs runs v3's kernel), v2 runs a processing stage first and the top-N
    as torch ops after."""
    lv = view(logits, "logits")
    check_dtype(lv, FLOAT_DTYPES)
    check_ndim(lv, 2)
    rows, vocab = lv.shape
    if vocab == 0:
        raise ValueError(f"{lv.describe()}: the vocabulary is empty")
    if vocab > 1 and lv.strides[1] != 1:
        raise ValueError(f"{lv.describe()}: rows must be contiguous, got strides {lv.strides}")
    views = [lv]
    if isinstance(top_k, int) and not isinstance(top_k, bool):
        # k >= vocab is "off" as much as k = 2^31 - 1, and k <= 0 as much as -2^31
        top_k = min(max(top_k, _INT32[0]), _INT32[1])
    values = (temperature, top_p, top_k, seeds, offsets)
    arrays: dict[str, object] = {}
    for (name, dtype), value in zip(_PARAMS, values, strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            arrays[name] = _checked(value, name, dtype, (rows,), views)
        elif dtype.startswith("int") and not isinstance(value, int):
            raise TypeError(f"{name} must be an int or an {dtype} array, got {value!r}")
        elif dtype == "int64" and not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(
                f"{name} = {value} is outside the int64 range [{_INT64[0]}, {_INT64[1]}]"
            )
    if out is not None:
        ov = _checked(out, "out", "int32", (rows,), views)
    given = {
        "token_offsets": token_offsets,
        "token_ids": token_ids,
        "token_counts": token_counts,
        "token_bias": token_bias,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "repetition_penalty": repetition_penalty,
        "bitmask": bitmask,
        "bitmask_rows": bitmask_rows,
        "min_p": min_p,
    }
    processing, checked = _check_processing(given, rows, vocab, views)
    lpv = _check_logprob_outputs(logprobs, top_ids, top_logprobs, rows, vocab, views)
    common_device(views)
    if not kernel_or_reference("sample", views, support.sample(lv.dtype, vocab)):
        reference = reference_on_torch("sample", views)
        _check_indices(processing, checked, vocab)
        return reference.sample(
            logits,
            temperature,
            top_p,
            top_k,
            seeds,
            offsets,
            out,
            logprobs=logprobs,
            top_ids=top_ids,
            top_logprobs_out=top_logprobs,
            **processing,
        )
    if rows == 0:
        return out if out is not None else empty_like(lv, (0,), "int32")
    module, device, handle = launch_context(views, stream)
    variant = kernel_variant("sample")
    if variant == AUTO:
        variant = measured_variant(bool(processing), lpv is not None or top_ids is not None)
    fused = variant in (0, 2)  # v3 / v4: top-N in the kernel, a workspace only for sparse entries
    # scalar parameters filled, outputs and workspaces allocated on the launch stream
    with on_launch_stream(views, device, handle):
        for (name, dtype), value in zip(_PARAMS, values, strict=True):
            if name not in arrays:
                arrays[name] = view(full_like(lv, (rows,), value, dtype), name)
        if out is None:
            out = empty_like(lv, (rows,), "int32")
            ov = view(out, "out")
        ptr = {name: pv.ptr for name, pv in checked.items()}
        if "token_ids" in checked and checked["token_ids"].numel == 0:
            for name in _SPARSE + _PENALTIES:  # no entries: nothing to apply (and no pointers)
                ptr.pop(name)
        # v4 with logprob outputs: v3's kernel (the split kernels write none); greedy known on the
        # host: v3's single pass (the split costs 10 launches whatever the rows need)
        slices = 1
        greedy = isinstance(temperature, (int, float)) and not temperature > 0
        if variant == 2 and lpv is None and top_ids is None and not greedy:
            slices = split_slices(rows, vocab, ITEMSIZE[lv.dtype], sm_count(module, device))
        split_state = None
        if slices > 1:
            split_state = empty_like(lv, (rows, split_state_words(slices)), "int64", "split_state")
        workspace, stride = None, 0
        if "token_offsets" in ptr or (not fused and "bitmask" in ptr):
            # v3: entry values at their ids + the entry bitmap; v2: the processed rows
            # (16-byte rows)
            stride = _round4(vocab) + (_round4((vocab + 31) // 32) if fused else 0)
            workspace = empty_like(lv, (rows, stride), "float32", name="workspace")
        top_n = 0 if top_ids is None or not fused else view(top_ids, "top_ids").shape[1]
        module.sample(
            out=ov.ptr,
            logits=lv.ptr,
            temperature=arrays["temperature"].ptr,
            top_p=arrays["top_p"].ptr,
            top_k=arrays["top_k"].ptr,
            seeds=arrays["seeds"].ptr,
            offsets=arrays["offsets"].ptr,
            rows=rows,
            vocab=vocab,
            logits_stride=lv.strides[0],
            dtype=DTYPE_CODES[lv.dtype],
            token_offsets=ptr.get("token_offsets", 0),
            token_ids=ptr.get("token_ids", 0),
            token_counts=ptr.get("token_counts", 0),
            token_bias=ptr.get("token_bias", 0),
            presence_penalty=ptr.get("presence_penalty", 0),
            frequency_penalty=ptr.get("frequency_penalty", 0),
            repetition_penalty=ptr.get("repetition_penalty", 0),
            bitmask=ptr.get("bitmask", 0),
            bitmask_rows=ptr.get("bitmask_rows", 0),
            bitmask_words=(vocab + 31) // 32,
            num_masks=checked["bitmask"].shape[0] if "bitmask" in checked else 0,
            nnz=checked["token_ids"].shape[0] if "token_ids" in checked else 0,
            check_indices=check_indices(),
            min_p=ptr.get("min_p", 0),
            logprobs=0 if lpv is None else lpv.ptr,
            top_ids=view(top_ids, "top_ids").ptr if top_n else 0,
            top_logprobs=view(top_logprobs, "top_logprobs").ptr if top_n else 0,
            top_n=top_n,
            workspace=0 if workspace is None else view(workspace, "workspace").ptr,
            workspace_stride=stride,
            slices=slices,
            split_state=0 if split_state is None else view(split_state, "split_state").ptr,
            split_state_stride=0 if split_state is None else split_state_words(slices),
            device=device,
            stream=handle,
            variant=variant,
        )
        if top_ids is not None and rows and not fused:
            # v2 has no top-N in its kernels: torch ops on the processed logits (the sampled
            # tokens' logprobs too, from the same log-softmax as the top-N: the kernel's own
            # rounded apart from torch's, so a greedy row's differed from its top-1).
            from ..reference.logits_processing import write_top_logprobs

            reference_on_torch("sample (top-N logprobs)", views)  # torch tensors only
            write_top_logprobs(
                logits, temperature, top_ids, top_logprobs, out, logprobs, **processing
            )
    return out


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def _checked(value, name: str, dtype: str, shape, views: list) -> ArrayView:
    """`value` as a contiguous `dtype` array of `shape`, added to `views` (errors name it)."""
    av = view(value, name)
    check_dtype(av, (dtype,))
    check_shape(av, shape)
    check_contiguous(av)
    views.append(av)
    return av


def _check_processing(
    given: dict, rows: int, vocab: int, views: list
) -> tuple[dict, dict[str, ArrayView]]:
    """The processing arrays that were given, checked (dtype, shape, contiguity, groups), and
    their views."""
    present = {name: value for name, value in given.items() if value is not None}
    sparse = [name for name in _SPARSE if name in present]
    if sparse and len(sparse) != len(_SPARSE):
        raise ValueError(f"give all of {', '.join(_SPARSE)} or none, got only {sparse}")
    if sparse and any(name not in present for name in _PENALTIES):
        raise ValueError(f"the sparse token entries need {', '.join(_PENALTIES)} too")
    if ("bitmask" in present) != ("bitmask_rows" in present):
        raise ValueError("give bitmask and bitmask_rows together")
    nnz = 0
    if "token_ids" in present:
        tv = view(present["token_ids"], "token_ids")
        check_ndim(tv, 1)
        nnz = tv.shape[0]
    checked = {
        name: _checked(present[name], name, dtype, shape(rows, vocab, nnz), views)
        for name, dtype, shape in _PROCESSING
        if name in present
    }
    return present, checked


def _check_indices(processing: dict, checked: dict[str, ArrayView], vocab: int) -> None:
    """The processing arrays' values (index_checks.check_sampling_indices; torch tensors)."""
    if "token_offsets" in processing or "bitmask_rows" in processing:
        check_sampling_indices(
            processing.get("token_offsets"),
            processing.get("token_ids"),
            processing.get("bitmask_rows"),
            vocab,
            checked["bitmask"].shape[0] if "bitmask" in checked else 0,
        )


def _check_logprob_outputs(
    logprobs, top_ids, top_logprobs, rows: int, vocab: int, views: list
) -> ArrayView | None:
    """Checks the optional outputs; the view of `logprobs` (None when not given)."""
    if (top_ids is None) != (top_logprobs is None):
        raise ValueError("give top_ids and top_logprobs together")
    lv = None if logprobs is None else _checked(logprobs, "logprobs", "float32", (rows,), views)
    if top_ids is not None:
        iv, tv = view(top_ids, "top_ids"), view(top_logprobs, "top_logprobs")
        check_dtype(iv, ("int32",))
        check_dtype(tv, ("float32",))
        check_ndim(iv, 2)
        if iv.shape[0] != rows or iv.shape[1] > min(MAX_TOP_LOGPROBS, vocab):
            raise ValueError(
                f"{iv.describe()}: must be [{rows}, N] with N <= {MAX_TOP_LOGPROBS} and N <= the "
                f"vocabulary ({vocab})"
            )
        check_shape(tv, iv.shape)
        if iv.numel:  # (N = 0: nothing written, and an empty array's strides say nothing)
            check_contiguous(iv)
            check_contiguous(tv)
        views += [iv, tv]
    return lv
