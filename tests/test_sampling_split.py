"""sample v4 (csrc/sampling_split.cu): a row split over several CTAs at small batch. The split plan
on the CPU (ops.sampling.split_slices); the kernels through the emulator (tests/emulator) draw for
draw against reference.sample on fresh random logits over odd vocabularies, several batch sizes,
every parameter family and the logits processing, with poisoned outputs and workspaces; the
kernel's own argument checks; and the built binary's machine code (both architectures)."""

from __future__ import annotations

import math

import pytest
import torch
from emulator import emulated, launches, unavailable_reason

import pagedkern
from pagedkern import reference
from pagedkern.ops import sampling as ops_sampling
from pagedkern.ops.sampling import MAX_SLICES, split_slices, split_state_words

LLAMA3_VOCAB = 128256
SPLIT_LAUNCHES = 10  # argmax + 8 descent steps + draw (csrc/sampling_split.cu)

emulator = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


# ---- the plan (host code: no GPU, no extension) ------------------------------------------------


@pytest.mark.parametrize("itemsize, min_slice", [(4, 2048), (2, 4096)])
@pytest.mark.parametrize("rows", [1, 4, 8, 66])
def test_split_fills_one_wave_at_small_batch(rows, itemsize, min_slice):
    sms = 132
    slices = split_slices(rows, LLAMA3_VOCAB, itemsize, sms)
    # one wave of CTAs (never more than the SMs), all of it unless every slice is at its
    # minimum of one 16-byte load per thread
    assert rows * slices <= sms
    assert rows * (slices + 1) > sms or slices == LLAMA3_VOCAB // min_slice
    assert LLAMA3_VOCAB // slices >= min_slice
    assert 1 < slices <= MAX_SLICES


@pytest.mark.parametrize(
    "rows, vocab, itemsize, sms",
    [(132, LLAMA3_VOCAB, 4, 132), (67, LLAMA3_VOCAB, 4, 132), (500, LLAMA3_VOCAB, 2, 132),
     (0, 1000, 4, 132),
     (1, 1, 4, 132), (1, 4095, 2, 132), (3, 2047, 4, 108)],
)  # fmt: skip
def test_no_split_when_the_rows_fill_the_gpu_or_the_row_is_short(rows, vocab, itemsize, sms):
    assert split_slices(rows, vocab, itemsize, sms) == 1


def test_split_is_capped_and_the_state_grows_with_the_slices():
    assert split_slices(1, 1 << 22, 4, 1024) == MAX_SLICES
    assert split_slices(2, 10000, 4, 132) == 10000 // 2048
    assert split_state_words(7) - split_state_words(6) == 3
    assert split_state_words(1) >= 16 + 2 * 2 * 256  # control words, two double histograms


# ---- the kernels, emulated ---------------------------------------------------------------------


@pytest.fixture
def poisoned(monkeypatch):
    """Every array ops.sample allocates (outputs, v3's entry workspace, v4's merge state) is
    poisoned: NaN floats, -1 (all bits set) integers; nothing may be read before it is written."""
    real = ops_sampling.empty_like

    def empty_like(a, shape, dtype=None, name="out"):
        x = real(a, shape, dtype, name)
        x.fill_(math.nan if x.is_floating_point() else -1)
        return x

    monkeypatch.setattr(ops_sampling, "empty_like", empty_like)


def _forced(monkeypatch, slices: int) -> None:
    """ops.sample runs v4 and plans `slices` CTAs per row whatever the sizes (slices of 32
    elements up; the kernel drops the empty ones)."""
    monkeypatch.setenv("PAGEDKERN_KERNELS", "sample:v4")
    monkeypatch.setattr(ops_sampling, "split_slices", lambda rows, vocab, itemsize, sms: slices)


@emulator
def test_auto_takes_the_variant_measured_fastest_for_the_call(monkeypatch, kernels):
    """auto: plain sampling on v2 (one sampling kernel), a call with logits processing or
    logprob outputs on v4 (v3's fused kernel here: the logprob outputs, or no split planned)."""
    kernels(sample="auto")
    ran = []
    real = ops_sampling.measured_variant

    def spy(processing, logprob_outputs):
        ran.append(real(processing, logprob_outputs))
        return ran[-1]

    monkeypatch.setattr(ops_sampling, "measured_variant", spy)
    logits = torch.randn(3, 200)
    with emulated():
        plain = pagedkern.sample(logits, 1.0, 0.9, 0, 5, 0)
        lp = torch.empty(3)
        pagedkern.sample(logits, 1.0, 0.9, 0, 5, 0, logprobs=lp)
        pagedkern.sample(logits, 1.0, 0.9, 0, 5, 0, min_p=torch.full((3,), 0.1))
    assert ran == [ops_sampling.V2, ops_sampling.V4, ops_sampling.V4]
    assert plain.tolist() == reference.sample(logits, 1.0, 0.9, 0, 5, 0).tolist()


def _special_rows(rows, vocab, g):
    x = torch.randn(rows, vocab, generator=g) * 3
    x[0] = x[0].round()  # ties, -0.0
    if rows > 1:
        x[1, ::5] = math.nan
    if rows > 2:
        x[2, torch.randperm(vocab, generator=g)[:3]] = math.inf
    if rows > 3:
        x[3] = -math.inf
        x[3, vocab - 1] = -5.0  # one finite entry, in the last slice
    if rows > 4:
        x[4] = math.nan
    if rows > 5:
        x[5, : min(4, vocab)] = 100.0  # overflows at temperature 1e-37
    if rows > 6:
        x[6, : vocab // 2] = -math.inf
    return x


# (temperature, top_p, top_k, min_p): greedy, temperature, top-p, top-k, both, min-p
FAMILIES = [
    (0.0, 1.0, 0, 0.0),
    (1.0, 1.0, 0, 0.0),
    (0.7, 0.9, 0, 0.0),
    (1.3, 1.0, 40, 0.0),
    (1.0, 0.6, 5, 0.0),
    (2.0, 0.95, 1, 0.0),
    (1.0, 1.0, 0, 0.2),
    (0.8, 0.9, 100, 0.05),
]


def _draw(logits, temps, top_p, top_k, seeds, offset, **processing):
    """(kernel ids, reference ids, kernel launches); out poisoned with -1 beforehand."""
    rows = logits.shape[0]
    out = torch.full((rows,), -1, dtype=torch.int32)
    ref = reference.sample(logits, temps, top_p, top_k, seeds, offset, **processing)
    before = launches()
    pagedkern.sample(logits, temps, top_p, top_k, seeds, offset, out=out, **processing)
    return out, ref, launches() - before


@emulator
@pytest.mark.parametrize(
    "dtype, vocab, rows, slices",
    [(torch.float32, 203, 7, 3), (torch.float32, 200, 8, 7), (torch.bfloat16, 96, 4, 2),
     (torch.float16, 31, 3, 5), (torch.float32, 1, 2, 4), (torch.bfloat16, 4097, 1, 9)],
)  # fmt: skip
def test_split_draws_the_reference_ids(monkeypatch, poisoned, dtype, vocab, rows, slices):
    # Small slices (32 elements up) forced on small rows: every slice boundary, empty and short
    # last slices, special rows (ties, NaN, +inf, all -inf, overflow), every parameter family.
    _forced(monkeypatch, slices)
    g = torch.Generator().manual_seed(vocab * 31 + rows)
    logits = _special_rows(rows, vocab, g).to(dtype)
    temps = torch.rand(rows, generator=g) + 0.3
    temps[-1] = 1e-37 if rows > 5 else temps[-1]
    with emulated():
        for n, (t, top_p, top_k, min_p) in enumerate(FAMILIES):
            seeds = torch.randint(0, 2**62, (rows,), generator=g)
            row_temps = temps * t if t else torch.zeros(rows)
            min_p = torch.full((rows,), min_p)
            out, ref, launched = _draw(logits, row_temps, top_p, top_k, seeds, n, min_p=min_p)
            assert launched == SPLIT_LAUNCHES
            assert out.tolist() == ref.tolist(), (t, top_p, top_k, min_p)


@emulator
@pytest.mark.parametrize(
    "dtype, vocab, rows", [(torch.float32, 4097, 3), (torch.bfloat16, 50257, 1)]
)
def test_split_at_the_planned_size_draws_the_reference_ids(poisoned, dtype, vocab, rows):
    # The real plan (the emulator reports 132 SMs): 2 and 12 slices of >= 512 x 16 bytes.
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert split_slices(rows, vocab, itemsize, 132) > 1
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[0, vocab - 3] = 30.0  # the likeliest token in the last slice
    with emulated():
        for n, (t, top_p, top_k, min_p) in enumerate([(1.0, 1.0, 0, 0.0), (0.9, 0.8, 50, 0.1)]):
            seeds = torch.randint(0, 2**62, (rows,), generator=g)
            temps, min_p = torch.full((rows,), t), torch.full((rows,), min_p)
            out, ref, launched = _draw(logits, temps, top_p, top_k, seeds, n, min_p=min_p)
            assert launched == SPLIT_LAUNCHES
            assert out.tolist() == ref.tolist()


@emulator
@pytest.mark.parametrize("dtype, vocab, slices", [(torch.float32, 203, 4), (torch.bfloat16, 96, 3)])
def test_split_with_logits_processing_draws_the_reference_ids(
    monkeypatch, poisoned, dtype, vocab, slices
):
    # Penalties, bias, -inf bans, bitmasks and min-p (tests/test_kernels_emulated.py's case):
    # each CTA processes the sparse entries of its own slice; ids equal the reference's.
    from test_kernels_emulated import _processing_case

    _forced(monkeypatch, slices)
    g = torch.Generator().manual_seed(vocab + 2)
    rows = 8
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    logits[1, 4] = math.nan
    processing = _processing_case(rows, vocab, g)
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5])
    with emulated():
        for top_p, top_k in [(1.0, 0), (0.8, 0), (0.9, 7), (1.0, 3)]:
            seeds = torch.randint(0, 2**62, (rows,), generator=g)
            out, ref, launched = _draw(logits, temps, top_p, top_k, seeds, 3, **processing)
            assert launched == SPLIT_LAUNCHES
            assert out.tolist() == ref.tolist(), (top_p, top_k)


@emulator
def test_logprob_outputs_run_the_one_cta_kernel(monkeypatch, poisoned):
    # The split kernels write no logprobs: such a call runs v3's kernel (one launch), still exact.
    _forced(monkeypatch, 4)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 200, generator=g)
    lp, ref_lp = torch.full((3,), math.nan), torch.full((3,), math.nan)
    seeds = torch.arange(3) + 1
    ref = reference.sample(logits, 1.0, 0.9, 0, seeds, 0, logprobs=ref_lp)
    before = launches()
    with emulated():
        ids = pagedkern.sample(logits, 1.0, 0.9, 0, seeds, 0, logprobs=lp)
    assert launches() == before + 1
    assert ids.tolist() == ref.tolist()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)


@emulator
def test_greedy_known_on_the_host_runs_the_one_cta_kernel(monkeypatch):
    # temperature 0 as a Python number: v3's single pass, not the 10 launches of the split.
    _forced(monkeypatch, 4)
    logits = torch.randn(3, 200)
    for temperature, launched in [(0.0, 1), (-1, 1), (torch.zeros(3), SPLIT_LAUNCHES)]:
        before = launches()
        with emulated():
            ids = pagedkern.sample(logits, temperature, 1.0, 0, 5, 0)
        assert launches() == before + launched
        assert ids.tolist() == logits.argmax(-1).tolist()


@emulator
def test_v3_never_splits(monkeypatch, kernels):
    _forced(monkeypatch, 4)
    kernels(sample="v3")
    logits = torch.randn(2, 200)
    before = launches()
    with emulated():
        ids = pagedkern.sample(logits, 1.0, 1.0, 0, 5, 0)
    assert launches() == before + 1
    assert ids.tolist() == reference.sample(logits, 1.0, 1.0, 0, 5, 0).tolist()


def _raw_sample(module, logits, out, params, **overrides):
    """module.sample on CPU tensors (emulated: every pointer is 'device memory')."""
    kwargs = dict(
        out=out.data_ptr(), logits=logits.data_ptr(), rows=logits.shape[0], vocab=logits.shape[1],
        logits_stride=logits.shape[1], dtype=0, token_offsets=0, token_ids=0, token_counts=0,
        token_bias=0, presence_penalty=0, frequency_penalty=0, repetition_penalty=0, bitmask=0,
        bitmask_rows=0, bitmask_words=0, num_masks=0, nnz=0, check_indices=True, min_p=0,
        logprobs=0, top_ids=0, top_logprobs=0,
        top_n=0, workspace=0, workspace_stride=0, slices=4, split_state=0,
        split_state_stride=0, device=0, stream=0, variant=2,
        **{name: t.data_ptr() for name, t in params.items()},
    )  # fmt: skip
    kwargs.update(overrides)
    module.sample(**kwargs)


@emulator
@pytest.mark.parametrize(
    "overrides, message",
    [({"split_state_stride": split_state_words(4) - 1}, "split_state"),
     ({"split_state": 0}, "split_state"),
     ({"variant": 0}, "slices > 1 needs variant 2"),
     ({"slices": 0}, "slices must be in"),
     ({"logprobs": "lp"}, "writes no logprobs")],
)  # fmt: skip
def test_the_kernel_refuses_a_bad_split(overrides, message):
    # csrc/sampling.cu checks the split arguments before any launch: a clear error, no write.
    logits = torch.randn(2, 200)
    out = torch.full((2,), -1, dtype=torch.int32)
    state = torch.full((2, split_state_words(4)), -1, dtype=torch.int64)
    lp = torch.zeros(2)
    params = dict(
        temperature=torch.ones(2), top_p=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int32),
        seeds=torch.zeros(2, dtype=torch.int64), offsets=torch.zeros(2, dtype=torch.int64),
    )  # fmt: skip
    overrides = {k: lp.data_ptr() if v == "lp" else v for k, v in overrides.items()}
    overrides.setdefault("split_state", state.data_ptr())
    overrides.setdefault("split_state_stride", split_state_words(4))
    with emulated(expect_launch=False) as module:
        before = launches()
        with pytest.raises(ValueError, match=message):
            _raw_sample(module, logits, out, params, **overrides)
        assert launches() == before
        _raw_sample(module, logits, out, params, split_state=state.data_ptr(),
                    split_state_stride=split_state_words(4))  # fmt: skip
        assert launches() == before + SPLIT_LAUNCHES
    assert out.tolist() == reference.sample(logits, 1.0, 1.0, 0, 0, 0).tolist()


# ---- machine code of the built extension -------------------------------------------------------

SPLIT_KERNELS = ("sample_split_argmax_kernel", "sample_split_descend_kernel",
                 "sample_split_draw_kernel")  # fmt: skip


@pytest.mark.static
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("kernel", SPLIT_KERNELS)
def test_split_kernels_built_without_spills_and_with_sixteen_byte_loads(cuda_binary, arch, kernel):
    resources = {n: r for n, r in cuda_binary.resources(arch).items() if kernel in n}
    assert len(resources) == 6, f"{kernel}: fp32 / fp16 / bf16 x vector / scalar ({arch})"
    assert not any(r.local or r.stack for r in resources.values()), resources
    sass = cuda_binary.sass(arch)
    for vectorized in ("IfLi4", "I13__nv_bfloat16Li8", "I6__halfLi8"):
        (name,) = [n for n in sass if kernel in n and vectorized in n]
        assert "LDG.E.128" in sass[name], f"{name}: no 16-byte logits loads ({arch})"


@pytest.mark.static
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_split_descent_merges_with_global_integer_atomics_after_a_warp_aggregated_pass(
    cuda_binary, arch
):
    # The slice's histogram as v3's (MATCH.ANY + REDUX.SUM), merged into the row's with 64-bit
    # global atomics (RED/ATOMG .64: exact, order-free) behind a fence (MEMBAR) and the counter.
    for name, sass in cuda_binary.sass(arch).items():
        if "sample_split_descend_kernel" not in name:
            continue
        assert "MATCH.ANY" in sass and "REDUX.SUM" in sass, name
        assert any(op in sass for op in ("RED.E.ADD.64", "ATOMG.E.ADD.64")), name
        assert "MEMBAR" in sass, name
