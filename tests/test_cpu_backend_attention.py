"""The CPU backend's attention (ops/cpu/attention.py: the C++ kernel and the BLAS tiles, each
variant) against the reference, as the CUDA kernels are tested: fresh random inputs over odd
shapes (GQA groups, block sizes that do not divide the key tile, lengths across tile
boundaries), NaN-poisoned caches and outputs (NaN never passes), fp32 / bf16 / fp8 caches, the
attention options, the log-sum-exp; and the batch invariance the engine relies on: a query
row's bits do not depend on its chunk, its neighbours, or whether it is a decode row."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_check import assert_close_to, poisoned
from support.key_spans import record_key_spans

from pagedkern import ops, reference
from pagedkern.ops.cpu import attention, attention_kernel

D = 64


@pytest.fixture(params=["kernel", "tiles"])
def variant(request, kernels):
    """Runs the test on each cpu_attention variant."""
    if request.param == "kernel" and not attention_kernel.applies(torch.empty(1), D):
        pytest.skip("pagedkern._cpu is not built")
    kernels(cpu_attention=request.param)
    return request.param


def _paged(seq_lens, hkv, block_size, dtype, g, d=D):
    """NaN-poisoned paged caches holding random K/V of each sequence, shuffled pages, and int32
    block tables whose unused entries point at a poisoned spare page."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    spare = order[sum(needed)]
    tables = torch.full((len(seq_lens), max(max(needed), 1)), spare, dtype=torch.int32)
    k_cache = torch.full((num_blocks, hkv, block_size, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(seq_lens):
        pages, order = order[: needed[b]], order[needed[b] :]
        tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        t = torch.arange(n)
        page, offset = torch.tensor(pages, dtype=torch.long)[t // block_size], t % block_size
        k_cache[page, :, offset] = torch.randn(n, hkv, d, generator=g).to(dtype)
        v_cache[page, :, offset] = torch.randn(n, hkv, d, generator=g).to(dtype)
    return k_cache, v_cache, tables


def _prefill_inputs(chunks, seq_lens, hq, hkv, block_size, dtype, seed, d=D):
    g = torch.Generator().manual_seed(seed)
    k, v, tables = _paged(seq_lens, hkv, block_size, dtype, g, d)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(chunks), hq, d, generator=g).to(dtype)
    return q, k, v, cu, tables, torch.tensor(seq_lens, dtype=torch.int32)


SHAPES = [  # (hq, hkv, block size)
    (9, 3, 16),  # SmolLM2-135M
    (4, 1, 7),  # a block size that does not divide the key tile
    (6, 6, 32),  # no GQA
]
PREFILLS = [  # (chunks, seq_lens): whole prompts, chunks after a cached prefix, across tiles
    ([700], [700]),
    ([3, 40, 600], [700, 40, 1030]),
    ([1, 17, 5], [1, 17, 517]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,block_size", SHAPES)
@pytest.mark.parametrize("chunks,seq_lens", PREFILLS)
def test_flash_prefill_matches_the_reference(dtype, hq, hkv, block_size, chunks, seq_lens, variant):
    q, k, v, cu, tables, lens = _prefill_inputs(chunks, seq_lens, hq, hkv, block_size, dtype, 1)
    want, want_lse = reference.flash_prefill(q, k, v, cu, tables, lens, return_lse=True)
    out = poisoned(q.shape, dtype, "cpu")
    got, lse = attention.flash_prefill(q, k, v, cu, tables, lens, out=out, return_lse=True)
    assert got is out
    assert_close_to(got, want, dtype)
    assert_close_to(lse, want_lse, torch.float32)


@pytest.mark.parametrize("hq,hkv,block_size", SHAPES)
def test_paged_attention_matches_the_reference(hq, hkv, block_size, variant):
    seq_lens = [5, 0, 700, 1100, 33]  # a padding row (0) among them
    g = torch.Generator().manual_seed(2)
    k, v, tables = _paged(seq_lens, hkv, block_size, torch.float32, g)
    q = torch.randn(len(seq_lens), hq, D, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want, want_lse = reference.paged_attention(q, k, v, tables, lens, return_lse=True)
    out = poisoned(q.shape, torch.float32, "cpu")
    got, lse = attention.paged_attention(q, k, v, tables, lens, out=out, return_lse=True)
    assert_close_to(got, want, torch.float32)
    assert torch.equal(got[1], torch.zeros(hq, D)) and torch.isneginf(lse[1]).all()
    real = lens > 0
    assert_close_to(lse[real], want_lse[real], torch.float32)


@pytest.mark.parametrize(
    "options",
    [
        {"soft_cap": 20.0},
        {"sinks": "random"},
        {"soft_cap": 5.0, "sinks": "random"},
        {"sliding_window": 100},
        {"sliding_window": 7, "soft_cap": 5.0, "sinks": "random"},
    ],
    ids=["soft_cap", "sinks", "both", "window", "all"],
)
def test_options_match_the_reference(options, variant):
    q, k, v, cu, tables, lens = _prefill_inputs([600, 2], [600, 900], 9, 3, 16, torch.float32, 3)
    if options.get("sinks") == "random":
        options = {**options, "sinks": torch.randn(9, generator=torch.Generator().manual_seed(4))}
    want, want_lse = reference.flash_prefill(q, k, v, cu, tables, lens, return_lse=True, **options)
    got, lse = attention.flash_prefill(q, k, v, cu, tables, lens, return_lse=True, **options)
    assert_close_to(got, want, torch.float32)
    assert_close_to(lse, want_lse, torch.float32)
    decode = attention.paged_attention(q[-1:], k, v, tables[1:], lens[1:], **options)
    assert_close_to(
        decode,
        reference.paged_attention(q[-1:], k, v, tables[1:], lens[1:], **options),
        torch.float32,
    )


def test_a_sliding_window_runs_the_reference_on_the_tiles(kernels):
    kernels(cpu_attention="tiles")
    q, k, v, cu, tables, lens = _prefill_inputs([300], [700], 9, 3, 16, torch.float32, 5)
    want = reference.flash_prefill(q, k, v, cu, tables, lens, sliding_window=100)
    assert torch.equal(attention.flash_prefill(q, k, v, cu, tables, lens, sliding_window=100), want)
    want = reference.paged_attention(
        q[:2], k, v, tables.repeat(2, 1), lens.repeat(2), sliding_window=64
    )
    got = attention.paged_attention(
        q[:2], k, v, tables.repeat(2, 1), lens.repeat(2), sliding_window=64
    )
    assert torch.equal(got, want)


def test_fp8_cache_with_scales_matches_the_reference(variant):
    q, k, v, cu, tables, lens = _prefill_inputs([530, 9], [530, 1000], 9, 3, 16, torch.float32, 6)
    fp8 = torch.float8_e4m3fn
    k8 = (k / 0.02).clamp(-448, 448).to(fp8)  # NaN stays NaN
    v8 = (v / 0.03).clamp(-448, 448).to(fp8)
    scales = dict(k_scale=0.02, v_scale=0.03)
    want = reference.flash_prefill(q, k8, v8, cu, tables, lens, **scales)
    assert_close_to(
        attention.flash_prefill(q, k8, v8, cu, tables, lens, **scales), want, torch.float32
    )


def test_keys_within_one_tile_give_the_reference_to_rounding(kernels):
    """A row whose keys fit in one tile takes the one-tile path (no merge): the reference's
    function to within the rounding of a reduction over another width (the reference's keys
    end at its whole blocks, this backend's at the whole tile, and a BLAS may round the two
    apart), far inside the float32 tolerance of the multi-tile tests."""
    q, k, v, cu, tables, lens = _prefill_inputs(
        [200, 45, 3], [200, 45, 250], 9, 3, 16, torch.float32, 7
    )
    got = attention.flash_prefill(q, k, v, cu, tables, lens)
    want = reference.flash_prefill(q, k, v, cu, tables, lens)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_size", [16, 7])
def test_every_gemm_reduces_over_whole_key_tiles(monkeypatch, block_size, kernels):
    """What keeps a row's bits independent of its chunk on any BLAS: each scores GEMM spans,
    and each weighted sum reduces over, exactly one whole tile of keys, whatever the chunk,
    its length or its neighbours (a BLAS blocks a long reduction its own way: an AMD EPYC's
    MKL rounds a sum over 240 keys apart from the same sum over 256 with 16 zero weights)."""
    kernels(cpu_attention="tiles")
    tile = attention.key_tile(block_size)
    spans = record_key_spans(monkeypatch, D)
    q, k, v, cu, tables, lens = _prefill_inputs(
        [37, 1, 5, 300], [737, 20, 250, 1100], 9, 3, block_size, torch.float32, 11
    )
    attention.flash_prefill(q, k, v, cu, tables, lens)
    attention.paged_attention(q[:4], k, v, tables, lens)
    assert spans and set(spans) == {tile}, sorted(set(spans))


def test_a_row_is_the_same_bits_in_any_chunk_and_as_a_decode_row(variant):
    """Batch invariance: the row at position p, computed in a whole prompt, in a chunk starting
    anywhere, or as a decode row, alone or beside longer sequences, is the same bits; positions
    on either side of the key tile boundaries (256, 512)."""
    n = 1100
    q, k, v, cu, tables, lens = _prefill_inputs([n], [n], 9, 3, 16, torch.float32, 8)
    whole = attention.flash_prefill(q, k, v, cu, tables, lens)
    for p in (0, 3, 15, 16, 255, 256, 300, 511, 512, 513, 700, 1099):
        chunk = min(37, n - p)
        got = attention.flash_prefill(
            q[p : p + chunk],
            k,
            v,
            torch.tensor([0, chunk], dtype=torch.int32),
            tables,
            torch.tensor([p + chunk], dtype=torch.int32),
        )
        assert torch.equal(got[0], whole[p]), f"chunk starting at {p}"
        decode = attention.paged_attention(
            q[p : p + 1].repeat(3, 1, 1),
            k,
            v,
            tables.repeat(3, 1),
            torch.tensor([p + 1, n, 40], dtype=torch.int32),
        )
        assert torch.equal(decode[0], whole[p]), f"decode row at {p}"


def test_a_sequence_alone_equals_it_in_a_batch(variant):
    chunks, seq_lens = [600, 1, 64, 5], [600, 900, 64, 1030]
    q, k, v, cu, tables, lens = _prefill_inputs(chunks, seq_lens, 9, 3, 16, torch.float32, 9)
    batch = attention.flash_prefill(q, k, v, cu, tables, lens)
    for i in range(len(chunks)):
        a, b = int(cu[i]), int(cu[i + 1])
        alone = attention.flash_prefill(
            q[a:b],
            k,
            v,
            torch.tensor([0, b - a], dtype=torch.int32),
            tables[i : i + 1],
            lens[i : i + 1],
        )
        assert torch.equal(alone, batch[a:b]), f"sequence {i}"


def test_a_chunk_longer_than_its_sequence_is_refused(variant):
    q, k, v, cu, tables, lens = _prefill_inputs([10], [10], 9, 3, 16, torch.float32, 10)
    with pytest.raises(ValueError, match="seq_lens"):
        attention.flash_prefill(q, k, v, cu, tables, lens - 1)


def test_the_ops_run_it_on_the_cpu_backend(monkeypatch, variant):
    """ops.flash_prefill / ops.paged_attention on CPU tensors: the CPU implementation under
    'auto' and 'cpu', the reference under 'reference'."""
    q, k, v, cu, tables, lens = _prefill_inputs([40], [40], 9, 3, 16, torch.float32, 11)
    calls = []
    real = attention.flash_prefill
    from pagedkern.ops import cpu

    monkeypatch.setattr(
        cpu.implementations, "flash_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    for backend, expect in (("auto", 1), ("cpu", 2), ("reference", 2)):
        with ops.use_backend(backend):
            out = ops.flash_prefill(q, k, v, cu, tables, lens)
        assert len(calls) == expect, backend
        assert_close_to(out, reference.flash_prefill(q, k, v, cu, tables, lens), torch.float32)
