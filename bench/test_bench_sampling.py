"""sample: pagedkern's fused sort-free kernel vs a torch.sort-based top-p sampler (softmax, sort,
cumsum, mask, multinomial: the usual PyTorch recipe) and the PyTorch reference (which sorts too),
B = 128 rows of V = 128256 fp32 logits (Llama 3's vocabulary), temperature 0.8.
Cases: top-p 0.9; top-k 50 + top-p 0.95 (both radix descents); greedy (one pass).
Bytes: B * V * 4, one read of the logits (the kernel makes several passes, mostly from L2, so
GB/s here is the single-pass equivalent). Target: >= 5x faster than the sort-based top-p.
Small batch: v4 (a row split over several CTAs below the SM count) beside v3 / v2 (one
CTA per row) and the sort-based top-p at B = 1, 4, 8, 128."""

from __future__ import annotations

import pytest
import torch
from measure import compile_reference, gpu_paths, smoke_mode, with_compile

import pagedkern
from pagedkern import reference
from pagedkern.ops.sampling import split_slices

ROWS, VOCAB = (4, 1000) if smoke_mode() else (128, 128256)
CASES = {"top-p 0.9": (0.9, 0), "top-k 50 + top-p 0.95": (0.95, 50), "greedy": (1.0, 0)}
IMPLS = with_compile(["pagedkern", "torch sort top-p", "torch eager", "torch.compile sort top-p"])
BASELINE = "torch sort top-p"  # the target is set against it
TEMPERATURE = 0.8
_data: dict = {}
_compiled = {}


def sort_top_p(logits, temperature, top_p, top_k):
    """The common PyTorch sampler: full sort of the vocabulary (top-k applied on the sorted
    probabilities), cumulative sum, mask, multinomial."""
    probs = torch.softmax(logits / temperature, dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    drop = ranked.cumsum(-1) - ranked >= top_p
    if top_k > 0:
        drop[:, top_k:] = True
    ranked = ranked.masked_fill(drop, 0.0)
    return order.gather(-1, torch.multinomial(ranked, 1))[:, 0]


def make_data(device: str):
    if device not in _data:
        g = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(ROWS, VOCAB, generator=g, device=device) * 4
        seeds = torch.arange(ROWS, device=device, dtype=torch.int64) * 7919
        offsets = torch.zeros(ROWS, device=device, dtype=torch.int64)
        _data[device] = (logits, seeds, offsets)
    return _data[device]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_sample(measure, device, case, impl):
    logits, seeds, offsets = make_data(device)
    top_p, top_k = CASES[case]
    temperature = 0.0 if case == "greedy" else TEMPERATURE
    notes = {}
    if impl == "pagedkern":
        out = torch.empty(ROWS, dtype=torch.int32, device=device)
        params = (  # per-row arrays, as the engine passes them
            torch.full((ROWS,), temperature, device=device),
            torch.full((ROWS,), top_p, device=device),
            torch.full((ROWS,), top_k, dtype=torch.int32, device=device),
            seeds,
            offsets,
        )

        def fn():
            return pagedkern.sample(logits, *params, out=out)

        if case != "greedy":
            notes["target"] = ">= 5x torch sort top-p"
    elif impl == "torch eager":

        def fn():
            return reference.sample(logits, temperature, top_p, top_k, seeds, offsets)

    else:
        if case == "greedy":
            pytest.skip("greedy needs no sort (argmax)")
        sampler = sort_top_p
        if impl.startswith("torch.compile"):
            sampler = _compiled.setdefault("sort", compile_reference(sort_top_p))

        def fn():
            return sampler(logits, TEMPERATURE, top_p, top_k)

    result = measure(
        "sample",
        f"B={ROWS} V={VOCAB} {case}",
        impl,
        fn,
        bytes=ROWS * VOCAB * 4,
        baseline=BASELINE if case != "greedy" else "torch eager",
        **notes,
    )
    assert result.seconds > 0


# --- small batch: v4 splits a row over several CTAs when B < the SM count ----------
SMALL_ROWS = (1, 4) if smoke_mode() else (1, 4, 8, 128)
SMALL_IMPLS = ["pagedkern v4", "pagedkern v3", "pagedkern v2", "torch sort top-p"]
SMALL_CASES = {"top-p 0.9": (0.9, 0)}  # one case: 16 rows in the GPU check's bench budget


@pytest.mark.parametrize("impl", SMALL_IMPLS)
@pytest.mark.parametrize("case", list(SMALL_CASES))
@pytest.mark.parametrize("rows", SMALL_ROWS)
def test_sample_small_batch(measure, device, rows, case, impl, kernels):
    logits, seeds, offsets = (t[:rows] for t in make_data(device))
    top_p, top_k = SMALL_CASES[case]
    notes = {}
    if impl.startswith("pagedkern"):
        variant = impl.split()[-1]
        kernels(sample=variant)
        out = torch.empty(rows, dtype=torch.int32, device=device)
        params = (
            torch.full((rows,), TEMPERATURE, device=device),
            torch.full((rows,), top_p, device=device),
            torch.full((rows,), top_k, dtype=torch.int32, device=device),
            seeds,
            offsets,
        )

        def fn():
            return pagedkern.sample(logits, *params, out=out)

        if variant == "v4" and gpu_paths():
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            notes["slices"] = split_slices(rows, VOCAB, 4, sms)
            notes["target"] = "v4 >= 3x v3 at B <= 8, = v3 at B = 128"
    else:

        def fn():
            return sort_top_p(logits, TEMPERATURE, top_p, top_k)

    result = measure(
        "sample small batch",
        f"B={rows} V={VOCAB} {case}",
        impl,
        fn,
        bytes=rows * VOCAB * 4,
        baseline=BASELINE,
        **notes,
    )
    assert result.seconds > 0


# --- logits processing: all of it on vs the same chain of torch ops vs plain ---------
# "pagedkern processed" runs the default kernel variant (v3: one fused kernel, top-N inside),
# "... v2" the processing stage + sampling kernel with the top-N as torch ops after it.
PROC_ROWS = (1, 4) if smoke_mode() else (1, 64, 256)
PROC_IMPLS = [
    "pagedkern processed",
    "pagedkern processed v2",
    "torch chain (reference ops)",
    "pagedkern plain",
]
TOP_N = 5
_proc: dict = {}


def processing_inputs(rows: int, device: str):
    """Every processing input on: 64 penalised / biased tokens per row (a few bans), a grammar
    bitmask on every row, min-p 0.05, top-k 50, top-p 0.95, the sampled token's logprob and
    the top-5 logprobs."""
    key = (rows, device)
    if key not in _proc:
        g = torch.Generator(device="cpu").manual_seed(rows)
        logits = (torch.randn(rows, VOCAB, generator=g) * 4).to(device)
        per_row = 64
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:per_row] for _ in range(rows)])
        bias = torch.randn(rows, per_row, generator=g)
        bias[:, -2:] = float("-inf")
        words = (VOCAB + 31) // 32
        inputs = dict(
            token_offsets=torch.arange(rows + 1, dtype=torch.int32) * per_row,
            token_ids=ids.flatten().to(torch.int32),
            token_counts=torch.randint(0, 4, (rows * per_row,), generator=g, dtype=torch.int32),
            token_bias=bias.flatten(),
            presence_penalty=torch.full((rows,), 0.5),
            frequency_penalty=torch.full((rows,), 0.3),
            repetition_penalty=torch.full((rows,), 1.2),
            bitmask=torch.randint(-(2**31), 2**31, (rows, words), generator=g).to(torch.int32),
            bitmask_rows=torch.arange(rows, dtype=torch.int32),
            min_p=torch.full((rows,), 0.05),
        )
        inputs = {k: v.to(device) for k, v in inputs.items()}
        params = (
            torch.full((rows,), TEMPERATURE, device=device),
            torch.full((rows,), 0.95, device=device),
            torch.full((rows,), 50, dtype=torch.int32, device=device),
            torch.arange(rows, device=device, dtype=torch.int64) * 7919,
            torch.zeros(rows, device=device, dtype=torch.int64),
        )
        _proc[key] = (logits, params, inputs)
    return _proc[key]


@pytest.mark.parametrize("impl", PROC_IMPLS)
@pytest.mark.parametrize("rows", PROC_ROWS)
def test_sample_processed(measure, device, rows, impl, kernels):
    logits, params, inputs = processing_inputs(rows, device)
    out = torch.empty(rows, dtype=torch.int32, device=device)
    lp = torch.empty(rows, device=device)
    top_ids = torch.empty(rows, TOP_N, dtype=torch.int32, device=device)
    top = torch.empty(rows, TOP_N, device=device)
    outputs = dict(logprobs=lp, top_ids=top_ids)
    if impl.startswith("pagedkern processed"):
        kernels(sample="v2" if impl.endswith("v2") else "v3")

        def fn():
            return pagedkern.sample(logits, *params, out=out, top_logprobs=top, **outputs, **inputs)

    elif impl == "pagedkern plain":

        def fn():
            return pagedkern.sample(logits, *params, out=out)

    else:

        def fn():
            return reference.sample(logits, *params, out, top_logprobs_out=top, **outputs, **inputs)

    result = measure(
        "sample processed",
        f"B={rows} V={VOCAB} penalties+bias+bitmask+min-p+top-k/p+logprob+top-{TOP_N}",
        impl,
        fn,
        bytes=rows * VOCAB * 4,
        baseline="torch chain (reference ops)",
        target="v3 within 1.2x of plain, >= 5x the torch chain",
    )
    assert result.seconds > 0
