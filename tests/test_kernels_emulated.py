"""The CUDA sources of the decode kernels (paged_attention, rope_and_cache, sample), run on the CPU
through the emulator in tests/emulator (g++, no GPU) against the references: indexing, block
tables, split-KV partitioning and merge, pipeline waits, barriers and shuffles (divergence is an
error there), tie rules and fallbacks. Speed is not measured here; the GPU tests remain the
ground truth on real hardware. Skipped where g++, the CUDA headers or pybind11 are missing."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from emulator import emulated, launches, unavailable_reason

import pagedkern
from pagedkern import reference
from pagedkern.ops.paged_attention import decode_kernel
from pagedkern.ops.support import KernelUnsupportedError
from pagedkern.reference import cos_sin_cache

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_emulator_runs_the_existing_norm_kernels():
    # The emulator against kernels it did not come with: rms_norm's vector and scalar paths.
    g = torch.Generator().manual_seed(0)
    for hidden in (4096, 111):
        x = torch.randn(3, hidden, generator=g).bfloat16()
        w = torch.randn(hidden, generator=g).bfloat16()
        with emulated():
            out = pagedkern.rms_norm(x, w)
        torch.testing.assert_close(out, reference.rms_norm(x, w), rtol=0, atol=0)
        residual = torch.randn(3, hidden, generator=g).bfloat16()
        x2, r2 = x.clone(), residual.clone()
        with emulated():
            pagedkern.fused_add_rms_norm(x, residual, w)
        reference.fused_add_rms_norm(x2, r2, w)
        torch.testing.assert_close((x, residual), (x2, r2), rtol=0, atol=0)


def test_emulator_runs_silu_and_mul():
    g = torch.Generator().manual_seed(1)
    for d in (4096, 111):  # vector and scalar paths
        x = (4 * torch.randn(5, 2 * d, generator=g)).half()
        with emulated():
            out = pagedkern.silu_and_mul(x)
        expected = reference.silu_and_mul(x)
        # the kernel's __expf may differ from torch's expf in the last bits before rounding
        torch.testing.assert_close(out, expected, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("d", [1024, 111, 3])  # vector and scalar paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_emulator_runs_gelu_tanh_and_mul(d, dtype):
    g = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(7, 2 * d, generator=g)).to(dtype)
    x[0, :3] = torch.tensor([0.0, -12.0, 12.0])  # gelu's flat and linear ends
    out = torch.full((7, d), float("nan"), dtype=dtype)
    with emulated():
        pagedkern.gelu_tanh_and_mul(x, out=out)
    x64 = x.double()
    exact = torch.nn.functional.gelu(x64[:, :d], approximate="tanh") * x64[:, d:]
    error = ((out.double() - exact).norm() / exact.norm()).item()
    assert error <= {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert not torch.isnan(out).any()
    # the same rounding as the reference where torch's tanh and the kernel's tanhf agree
    torch.testing.assert_close(out, reference.gelu_tanh_and_mul(x), rtol=2e-3, atol=1e-3)


def _paged(seq_lens, hkv, block_size, d, dtype, g):
    """Caches with shuffled pages and NaN in every slot no sequence owns."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 2, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(needed) + 1), order[-1], dtype=torch.int32)
    k_cache = torch.full((len(order), hkv, block_size, d), math.nan, dtype=dtype)
    v_cache = k_cache.clone()
    for b, n in enumerate(seq_lens):
        pages, order = order[: needed[b]], order[needed[b] :]
        tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for t in range(n):
            k_cache[pages[t // block_size], :, t % block_size] = torch.randn(hkv, d, generator=g)
            v_cache[pages[t // block_size], :, t % block_size] = torch.randn(hkv, d, generator=g)
    return k_cache, v_cache, tables


# (dtype, D, block size, Hq, Hkv, seq_lens, num_splits, max_seq_len)
ATTENTION = [
    (torch.float16, 128, 16, 8, 2, [1, 15, 0, 16, 17, 100], None, None),
    (torch.bfloat16, 128, 16, 8, 2, [1, 15, 0, 16, 17, 100], 3, None),
    (torch.bfloat16, 64, 32, 9, 3, [33, 64, 65, 255], None, None),
    (torch.float16, 256, 64, 4, 4, [5, 130], 2, None),
    (torch.bfloat16, 128, 16, 12, 1, [70, 3], None, None),
    (torch.float16, 64, 16, 7, 1, [255, 1], 4, None),
    (torch.bfloat16, 64, 64, 16, 2, [129, 64, 0], 2, None),
    (torch.bfloat16, 64, 16, 34, 1, [40, 9], None, None),  # 17 head pairs: two CTAs
    (torch.float16, 256, 32, 18, 1, [37, 300], 3, None),
    (torch.float16, 64, 16, 4, 2, [700, 20], 3, 200),  # bound too small: last split runs on
]


@pytest.mark.parametrize("variant", ["simt", "mma"])  # mma: the fragments spelled as shuffles
@pytest.mark.parametrize("case", range(len(ATTENTION)))
def test_paged_attention(case, variant, kernels):
    dtype, d, block_size, hq, hkv, seq_lens, num_splits, max_seq_len = ATTENTION[case]
    kernels(paged_attention=variant)
    assert decode_kernel(hq // hkv, d) == ("simt" if d == 256 else variant)
    g = torch.Generator().manual_seed(case)
    k_cache, v_cache, tables = _paged(seq_lens, hkv, block_size, d, dtype, g)
    batch = len(seq_lens)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(batch, hq, d)  # a fused-QKV view: token stride (Hq + 2 Hkv) D
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full((batch, hq, d), math.nan, dtype=dtype)
    with emulated():
        result, lse = pagedkern.paged_attention(
            q, k_cache, v_cache, tables, lens, out=out, return_lse=True,
            num_splits=num_splits, max_seq_len=max_seq_len,
        )  # fmt: skip
    assert result is out
    ref, ref_lse = reference.paged_attention(
        q.double(), k_cache.double(), v_cache.double(), tables, lens, return_lse=True
    )
    assert not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-5, atol=1e-5)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d, misaligned", [(128, False), (64, True), (6, False)])
def test_rope_and_cache_is_bit_exact(dtype, d, misaligned):
    g = torch.Generator().manual_seed(d)
    tokens, hq, hkv, block_size = 23, 6, 2, 16
    off = 1 if misaligned else 0  # 2-byte offset: the scalar path
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d + off, generator=g).to(dtype)
    q = qkv[:, off : off + hq * d].view(tokens, hq, d)
    k = qkv[:, off + hq * d : off + (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, off + (hq + hkv) * d :].view(tokens, hkv, d)
    positions = torch.randint(0, 4096, (tokens,), generator=g, dtype=torch.int32)
    slots = torch.randperm(4 * block_size, generator=g)[:tokens].int()
    slots[::4] = -1
    cos_sin = cos_sin_cache(d, 4096)
    k_cache = torch.full((4, hkv, block_size, d), math.nan, dtype=dtype)
    v_cache = k_cache.clone()
    expected = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    reference.rope_and_cache(*expected[:3], positions, cos_sin, *expected[3:], slots)
    with emulated():
        pagedkern.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    for got, want in zip((q, k, v, k_cache, v_cache), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("variant", ["v2", "v1"])
@pytest.mark.parametrize("d, misaligned", [(128, False), (64, True)])
def test_rope_and_cache_variants_are_bit_exact(kernels, variant, d, misaligned):
    # 6 + 3 heads: v2's groups of 4 heads end in a partial group and one mixes q and k heads.
    kernels(rope_and_cache=variant)
    g = torch.Generator().manual_seed(7 + d)
    tokens, hq, hkv, block_size = 9, 6, 3, 8
    off = 1 if misaligned else 0
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d + off, generator=g).bfloat16()
    q = qkv[:, off : off + hq * d].view(tokens, hq, d)
    k = qkv[:, off + hq * d : off + (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, off + (hq + hkv) * d :].view(tokens, hkv, d)
    positions = torch.randint(0, 512, (tokens,), generator=g, dtype=torch.int32)
    slots = torch.randperm(3 * block_size, generator=g)[:tokens].int()
    slots[1] = -1
    cos_sin = cos_sin_cache(d, 512)
    k_cache = torch.full((3, hkv, block_size, d), math.nan, dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    expected = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    reference.rope_and_cache(*expected[:3], positions, cos_sin, *expected[3:], slots)
    with emulated():
        pagedkern.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    for got, want in zip((q, k, v, k_cache, v_cache), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("variant", ["v3", "v1"])
@pytest.mark.parametrize("hidden", [4096, 8192, 8192 + 64])  # 1, 2, 4 (no prefetch) vectors
def test_rms_norm_variants_are_bit_exact(kernels, variant, hidden):
    kernels(rms_norm=variant)
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(3, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    residual = torch.randn(3, hidden, generator=g).bfloat16()
    with emulated():
        out = pagedkern.rms_norm(x, w)
    torch.testing.assert_close(out, reference.rms_norm(x, w), rtol=0, atol=0)
    x2, r2 = x.clone(), residual.clone()
    with emulated():
        pagedkern.fused_add_rms_norm(x, residual, w)
    reference.fused_add_rms_norm(x2, r2, w)
    torch.testing.assert_close((x, residual), (x2, r2), rtol=0, atol=0)


def test_unknown_kernel_variant_is_a_clear_error(monkeypatch):
    # At the launch: the error names the variable, the op and the variants it has.
    monkeypatch.setenv("PAGEDKERN_KERNELS", "rope_and_cache:v9")
    x = torch.zeros(1, 1, 8).bfloat16()
    match = "PAGEDKERN_KERNELS: rope_and_cache must be one of v2, v1, got 'v9'"
    with pytest.raises(ValueError, match=match), emulated():
        pagedkern.rope_and_cache(
            x,
            x.clone(),
            x.clone(),
            torch.zeros(1, dtype=torch.int32),
            cos_sin_cache(8, 4),
            torch.zeros(1, 1, 16, 8).bfloat16(),
            torch.zeros(1, 1, 16, 8).bfloat16(),
            torch.full((1,), -1, dtype=torch.int32),
        )


def _special_rows(vocab, g):
    rows = torch.randn(8, vocab, generator=g) * 2
    rows[0] = rows[0].round()  # ties, -0.0
    rows[1, ::5] = math.nan
    rows[2, [4, 20, 30]] = math.inf
    rows[3] = -math.inf
    rows[3, 2] = -5.0  # one finite entry
    rows[4] = math.nan
    rows[5, :4] = torch.tensor([1.0, 5.0, 100.0, -3.0])  # overflows at temperature 1e-37
    rows[6, : vocab // 2] = -math.inf
    return rows


@pytest.mark.parametrize(
    "dtype, vocab", [(torch.float32, 203), (torch.float32, 200), (torch.bfloat16, 96)]
)
def test_sample_draws_the_reference_ids(dtype, vocab):
    # Same u and inverse CDF in vocabulary order as the reference: identical ids, row by row.
    g = torch.Generator().manual_seed(vocab)
    rows = _special_rows(vocab, g).to(dtype)
    temps = torch.tensor([1.0, 0.8, 2.0, 1.0, 1.0, 1e-37, 1.3, 0.0])
    n = 6
    seeds = torch.arange(8 * n) * 7919 + 2**33
    for top_p, top_k in [(1.0, 0), (0.9, 0), (0.3, 1), (0.7, 40), (0.95, 3), (0.0, 0)]:
        logits = rows.repeat(n, 1)
        ref = reference.sample(logits, temps.repeat(n), top_p, top_k, seeds, 11)
        with emulated():
            ids = pagedkern.sample(logits, temps.repeat(n), top_p, top_k, seeds, 11)
        assert ids.tolist() == ref.tolist(), (top_p, top_k)


def test_sample_per_row_parameters_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 256, generator=g)[:, :200]  # row stride 256
    temps = torch.rand(12, generator=g) + 0.2
    temps[0] = 0
    top_p = torch.rand(12, generator=g) * 0.7 + 0.3
    top_k = torch.randint(-1, 50, (12,), generator=g, dtype=torch.int32)
    seeds = torch.randint(0, 2**62, (12,), generator=g)
    offsets = torch.randint(0, 2**40, (12,), generator=g)
    out = torch.full((12,), -1, dtype=torch.int32)
    ref = reference.sample(logits, temps, top_p, top_k, seeds, offsets)
    with emulated():
        ids = pagedkern.sample(logits, temps, top_p, top_k, seeds, offsets, out=out)
    assert ids is out and out.tolist() == ref.tolist()


def test_sample_signed_zeros_are_one_tie():
    # top_k = 2 with the 2nd largest value 0.0 and a -0.0 beside it: both zeros are kept.
    row = torch.full((64,), -4.0)
    row[[3, 10, 20]] = torch.tensor([1.0, 0.0, -0.0])
    seeds = torch.arange(300) * 31 + 1
    ref = reference.sample(row.expand(300, -1), 1.0, 1.0, 2, seeds, 0)
    assert 20 in ref.tolist()
    with emulated():
        ids = pagedkern.sample(row.expand(300, -1), 1.0, 1.0, 2, seeds, 0)
    assert ids.tolist() == ref.tolist()


def _processing_case(rows, vocab, g):
    """Sparse penalty / bias entries (distinct per row, some -inf bans), a bitmask on every other
    row, min-p on some rows: fresh random inputs."""
    offsets, ids, counts, bias = [0], [], [], []
    for _ in range(rows):
        n = int(torch.randint(0, 9, (1,), generator=g))
        ids += torch.randperm(vocab, generator=g)[:n].tolist()
        counts += torch.randint(-1, 4, (n,), generator=g).tolist()
        bias += [float(b) for b in (torch.randn(n, generator=g) * 3)]
        if n:
            bias[-1] = -math.inf
        offsets.append(len(ids))
    words = (vocab + 31) // 32
    masks = torch.randint(-(2**31), 2**31, (rows // 2 + 1, words), generator=g, dtype=torch.int64)
    return dict(
        token_offsets=torch.tensor(offsets, dtype=torch.int32),
        token_ids=torch.tensor(ids, dtype=torch.int32),
        token_counts=torch.tensor(counts, dtype=torch.int32),
        token_bias=torch.tensor(bias, dtype=torch.float32),
        presence_penalty=torch.rand(rows, generator=g) * 4 - 2,
        frequency_penalty=torch.rand(rows, generator=g) * 4 - 2,
        repetition_penalty=torch.rand(rows, generator=g) * 1.5 + 0.5,
        bitmask=masks.to(torch.int32),
        bitmask_rows=torch.tensor(
            [r // 2 if r % 2 else -1 for r in range(rows)], dtype=torch.int32
        ),
        min_p=torch.tensor([0.0, 0.05, 0.3, 0.0] * (rows // 4) + [0.1] * (rows % 4)),
    )


@pytest.mark.parametrize("variant, launched", [("v3", 1), ("v2", 2)])
@pytest.mark.parametrize(
    "dtype, vocab", [(torch.float32, 203), (torch.float32, 200), (torch.bfloat16, 96)]
)
def test_sample_with_logits_processing_runs_the_kernel_and_matches_the_reference(
    kernels, dtype, vocab, variant, launched
):
    # csrc/sampling_fused.cu (v3: one kernel, top-N inside) and the processing stage + sampling
    # passes of csrc/sampling.cu (v2: top-N by torch ops) against reference.sample with the same
    # inputs: identical ids and top-N ids, the logprobs within 1e-5.
    kernels(sample=variant)
    g = torch.Generator().manual_seed(vocab + 1)
    rows = 10
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    logits[1, 4] = float("nan")
    logits[3, 7:40] = 1.5  # ties inside the top-N
    processing = _processing_case(rows, vocab, g)
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5, 1.0, 0.9])
    seeds = torch.arange(rows) * 7919 + 3
    with emulated():
        for top_p, top_k, n in [(1.0, 0, 5), (0.8, 0, 20), (0.9, 7, 1)]:
            ref_lp = torch.full((rows,), float("nan"))
            ref_ids, ref_top = torch.zeros(rows, n, dtype=torch.int32), torch.zeros(rows, n)
            ref = reference.sample(
                logits, temps, top_p, top_k, seeds, 5, logprobs=ref_lp, top_ids=ref_ids,
                top_logprobs_out=ref_top, **processing,
            )  # fmt: skip
            out = torch.full((rows,), -1, dtype=torch.int32)
            lp = torch.full((rows,), float("nan"))
            top_ids = torch.full((rows, n), -1, dtype=torch.int32)
            top = torch.full((rows, n), float("nan"))
            before = launches()
            pagedkern.sample(
                logits, temps, top_p, top_k, seeds, 5, out=out, logprobs=lp, top_ids=top_ids,
                top_logprobs=top, **processing,
            )  # fmt: skip
            assert launches() == before + launched
            assert out.tolist() == ref.tolist(), (top_p, top_k)
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
            assert torch.equal(top_ids, ref_ids), (top_p, top_k, n)
            torch.testing.assert_close(top, ref_top, rtol=0, atol=1e-5)


def test_emulated_fails_when_no_kernel_ran():
    # A test whose op never reached the kernel would otherwise compare the reference with itself.
    with pytest.raises(AssertionError, match="no kernel ran inside emulated"), emulated():
        pass
    before = launches()
    with emulated():
        pagedkern.silu_and_mul(torch.randn(2, 16))
    assert launches() == before + 1


@pytest.mark.parametrize(
    "dtype, d, block_size, reason",
    [(torch.float32, 64, 16, "dtype float32"), (torch.float16, 96, 16, "head_dim 96"),
     (torch.bfloat16, 64, 24, "block_size 24")],
)  # fmt: skip
def test_emulated_cases_outside_kernel_support_raise_instead_of_running_the_reference(
    dtype, d, block_size, reason
):
    k_cache, v_cache, tables = _paged([5, 30], 2, block_size, d, dtype, torch.Generator())
    q = torch.randn(2, 4, d).to(dtype)
    lens = torch.tensor([5, 30], dtype=torch.int32)
    before = launches()
    with (
        pytest.raises(KernelUnsupportedError, match=f"paged_attention: .*{reason}"),
        emulated(expect_launch=False),
    ):
        pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
    assert launches() == before


def _attention_case(block_size=16, seq_lens=(40, 9)):
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = _paged(list(seq_lens), 2, block_size, 64, torch.float16, g)
    q = torch.randn(len(seq_lens), 4, 64, generator=g).half()
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("variant", ["simt", "mma"])
@pytest.mark.parametrize("bad", ["minus_one", "past_the_cache", "seq_len_past_the_table"])
def test_paged_attention_traps_bad_indices_in_debug_mode(bad, variant, kernels):
    kernels(paged_attention=variant)
    q, k_cache, v_cache, tables, lens = _attention_case()
    if bad == "minus_one":
        tables[0, 1] = -1
    elif bad == "past_the_cache":
        tables[1, 0] = k_cache.shape[0]
    else:
        lens[0] = tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="__trap"), emulated():
        pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, num_splits=1)


def test_index_checks_cost_nothing_but_a_flag_when_off(monkeypatch):
    # Same kernels, check_indices=False in the params: the valid case still runs and matches.
    monkeypatch.setenv("PAGEDKERN_CHECK_INDICES", "0")
    q, k_cache, v_cache, tables, lens = _attention_case()
    with emulated():
        out = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens)
    ref = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens)
    assert float((out.double() - ref).norm() / ref.norm()) <= 2e-3


@pytest.mark.parametrize(
    "field, value", [("slot", 64), ("slot", -2), ("position", -1), ("position", 4096)]
)
def test_rope_and_cache_traps_bad_indices_in_debug_mode(field, value):
    tokens, d = 5, 64
    q, k = torch.randn(tokens, 4, d).half(), torch.randn(tokens, 2, d).half()
    v = torch.randn(tokens, 2, d).half()
    positions = torch.arange(tokens, dtype=torch.int32)
    slots = torch.arange(tokens, dtype=torch.int32)
    k_cache = torch.zeros(4, 2, 16, d).half()
    if field == "slot":
        slots[3] = value  # 4 blocks x 16 = 64 slots: 64 is one past the end; -1 alone skips
    else:
        positions[3] = value
    with pytest.raises(RuntimeError, match="__trap"), emulated():
        pagedkern.rope_and_cache(
            q, k, v, positions, cos_sin_cache(d, 4096), k_cache, k_cache.clone(), slots
        )


def test_sample_with_no_sparse_entries_and_min_p_only():
    # An empty sparse list (every row without penalties / biases) and min-p alone: the kernel
    # path without a processing stage (one launch) still equals the reference.
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 200, generator=g) * 3
    empty = dict(
        token_offsets=torch.zeros(7, dtype=torch.int32),
        token_ids=torch.zeros(0, dtype=torch.int32),
        token_counts=torch.zeros(0, dtype=torch.int32),
        token_bias=torch.zeros(0),
        presence_penalty=torch.zeros(6),
        frequency_penalty=torch.zeros(6),
        repetition_penalty=torch.ones(6),
        min_p=torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0, 0.2]),
    )
    seeds = torch.arange(6) + 5
    ref = reference.sample(logits, 1.0, 1.0, 0, seeds, 0, **empty)
    out = torch.full((6,), -1, dtype=torch.int32)
    before = launches()
    with emulated():
        pagedkern.sample(logits, 1.0, 1.0, 0, seeds, 0, out=out, **empty)
    assert launches() == before + 1 and out.tolist() == ref.tolist()
    assert ref.tolist() != reference.sample(logits, 1.0, 1.0, 0, seeds, 0).tolist()


@pytest.mark.parametrize("dtype, vocab", [(torch.float32, 203), (torch.bfloat16, 96)])
def test_sample_top_logprobs_in_the_kernel_on_special_rows(kernels, dtype, vocab):
    # v3's in-kernel top-N (no processing: one launch) on ties, NaN, +inf, all -inf rows and a
    # row with fewer finite values than N: ids exactly the reference's (ties to the lower id),
    # values within 1e-5, poisoned outputs all overwritten.
    kernels(sample="v3")
    g = torch.Generator().manual_seed(vocab + 5)
    rows = _special_rows(vocab, g)
    rows[6, : vocab - 3] = -math.inf  # 3 finite values, N = 20
    rows = rows.to(dtype)
    temps = torch.tensor([1.0, 0.8, 2.0, 1.0, 1.0, 0.0, 1.3, 0.0])
    seeds = torch.arange(8) * 31 + 7
    n = 20
    ref_ids, ref_top = torch.zeros(8, n, dtype=torch.int32), torch.zeros(8, n)
    ref_lp = torch.zeros(8)
    ref = reference.sample(
        rows, temps, 0.9, 0, seeds, 3, logprobs=ref_lp, top_ids=ref_ids, top_logprobs_out=ref_top
    )
    top_ids = torch.full((8, n), -1, dtype=torch.int32)
    top = torch.full((8, n), float("nan"))
    lp = torch.full((8,), float("nan"))
    before = launches()
    with emulated():
        ids = pagedkern.sample(
            rows, temps, 0.9, 0, seeds, 3, logprobs=lp, top_ids=top_ids, top_logprobs=top
        )
    assert launches() == before + 1
    assert ids.tolist() == ref.tolist()
    assert torch.equal(top_ids, ref_ids)
    torch.testing.assert_close(top, ref_top, rtol=0, atol=1e-5)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    assert not top.isnan().any() and (top <= 0).all()


@pytest.mark.parametrize("variant", ["v2", "v3", "v4"])
def test_sample_skips_sparse_ids_outside_the_vocabulary(monkeypatch, kernels, variant):
    """A bad sparse id (negative, or past the vocabulary) never writes outside its row: the
    workspace lies between canaries that must come back untouched, and every row samples what
    the reference samples with the bad entries left out."""
    kernels(sample=variant)
    sampling_module = importlib.import_module("pagedkern.ops.sampling")
    real_empty_like = sampling_module.empty_like
    guarded = []

    def with_canaries(a, shape, dtype=None, name="out"):
        if name != "workspace":
            return real_empty_like(a, shape, dtype, name)
        rows, stride = shape
        pad = 4 * stride  # room for any id within a few rows' reach on either side
        whole = torch.full((rows * stride + 2 * pad,), 12345.0)
        guarded.append((whole, pad, rows * stride))
        return whole[pad : pad + rows * stride].view(rows, stride)

    monkeypatch.setattr(sampling_module, "empty_like", with_canaries)
    g = torch.Generator().manual_seed(17)
    rows, vocab = 3, 203
    logits = torch.randn(rows, vocab, generator=g) * 2
    good = _processing_case(rows, vocab, g)
    good.pop("bitmask"), good.pop("bitmask_rows"), good.pop("min_p")
    offsets = good["token_offsets"].tolist()
    ids, counts = good["token_ids"].tolist(), good["token_counts"].tolist()
    bias = good["token_bias"].tolist()
    bad_ids = {0: [-3, vocab + 5], 2: [vocab, 3 * vocab]}  # row -> ids to slip in
    new_offsets, new_ids, new_counts, new_bias = [0], [], [], []
    for r in range(rows):
        span = range(offsets[r], offsets[r + 1])
        extra = bad_ids.get(r, [])
        new_ids += [ids[j] for j in span] + extra
        new_counts += [counts[j] for j in span] + [2] * len(extra)
        new_bias += [bias[j] for j in span] + [50.0] * len(extra)
        new_offsets.append(len(new_ids))
    bad = dict(
        good,
        token_offsets=torch.tensor(new_offsets, dtype=torch.int32),
        token_ids=torch.tensor(new_ids, dtype=torch.int32),
        token_counts=torch.tensor(new_counts, dtype=torch.int32),
        token_bias=torch.tensor(new_bias, dtype=torch.float32),
    )
    temps = torch.tensor([1.0, 0.0, 0.8])
    seeds = torch.tensor([3, 4, 5])
    want = reference.sample(logits, temps, 0.9, 0, seeds, 0, **good)
    out = torch.full((rows,), -1, dtype=torch.int32)
    with emulated():
        pagedkern.sample(logits, temps, 0.9, 0, seeds, 0, out=out, **bad)
    assert guarded, "the kernel used a workspace"
    for whole, pad, size in guarded:
        assert torch.all(whole[:pad] == 12345.0) and torch.all(whole[pad + size :] == 12345.0)
    assert out.tolist() == want.tolist()
