"""The CPU backend's decode steps under the tiles' attention (model/step_attention.py with
ops/cpu/decode_attention.py: the
decode rows' float32 K/V copies kept between steps) against the one-shot ops they replace
(PAGEDKERN_KERNELS=attention_plan:off: ops/cpu/attention.paged_attention every layer): the same
hidden states and KV-cache writes bit for bit, for fp32, int8 and int4 weights, fp8 caches, one
sequence, equal and unequal lengths, across key tiles, a decode row beside a prefill chunk,
speculative verification rows; and when a step reuses the last one's copy."""

from __future__ import annotations

import pytest
import torch
from support.key_spans import record_key_spans

from pagedkern import ops
from pagedkern.model import PRESETS, SequenceChunk, build_batch, load_model
from pagedkern.model.attention_metadata import verification_rows
from pagedkern.model.kv_cache import KVCache
from pagedkern.ops.cpu import decode_attention

BLOCK = 16


@pytest.fixture(autouse=True)
def _cpu_backend(kernels):
    """The CPU backend with the tiles' attention, whose decode plan this file tests (the
    kernel's step plan: tests/test_cpu_backend_attention_kernel.py)."""
    kernels(cpu_attention="tiles")
    with ops.use_backend("cpu"):
        yield


def _model(quantization: str = "none", **options):
    model, _ = load_model("synthetic:tiny", quantization=quantization, **options)
    return model


def _prefilled(model, lengths: list[int]):
    """A cache holding prompts of `lengths` tokens (shuffled block ids), and the next decode
    batch (one token per sequence)."""
    g = torch.Generator().manual_seed(sum(lengths))
    blocks = [-(-(n + 1) // BLOCK) for n in lengths]
    order = (torch.randperm(sum(blocks) + 4, generator=g) + 1).tolist()  # block 0 unused
    kv = model.allocate_kv_cache(sum(blocks) + 5, BLOCK)
    tables = []
    for n, b in zip(lengths, blocks, strict=True):
        tables.append(order[:b])
        order = order[b:]
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        batch, meta = build_batch([SequenceChunk(ids, 0, tables[-1])], BLOCK)
        model.hidden_states(batch, meta, kv)
    chunks = [SequenceChunk([3 + i], n, t) for i, (n, t) in enumerate(zip(lengths, tables))]
    return kv, build_batch(chunks, BLOCK)


def _next_step(lengths: list[int], tables: list[list[int]], k: int):
    """The decode batch k tokens after _prefilled's (one new token per sequence)."""
    chunks = [SequenceChunk([9 + i], n + k, t) for i, (n, t) in enumerate(zip(lengths, tables))]
    return build_batch(chunks, BLOCK)


def _one_shot(model, kernels, *steps_and_caches):
    """hidden_states of each (ids, meta, kv) through the one-shot attention ops."""
    kernels(attention_plan="off")
    try:
        return [model.hidden_states(*step) for step in steps_and_caches]
    finally:
        kernels(attention_plan="on")


@pytest.fixture(params=["host", "tensors"])
def bookkeeping(request, monkeypatch) -> str:
    """A step's decode-row bookkeeping on the host (a few rows) or as tensors (many)."""
    if request.param == "tensors":
        monkeypatch.setattr(decode_attention, "HOST_ENTRIES", 0)
    return request.param


@pytest.fixture
def gathers(monkeypatch) -> list[int]:
    """One entry per fresh gather of a layer's decode copy."""
    counted: list[int] = []
    gather = decode_attention.DecodeRows._gather

    def counting(self, *args):
        counted.append(1)
        return gather(self, *args)

    monkeypatch.setattr(decode_attention.DecodeRows, "_gather", counting)
    return counted


def _assert_planned_equals_one_shot(model, lengths: list[int], kernels) -> None:
    kv, (ids, meta) = _prefilled(model, lengths)
    before = kv.data.clone()
    planned_kv = KVCache(kv.data.clone(), kv.scales)
    (want,) = _one_shot(model, kernels, (ids, meta, kv))
    got = model.hidden_states(ids, meta, planned_kv)
    assert got.dtype == want.dtype == torch.float32 and not got.isnan().any()
    # Bit for bit: the same tiles on the same operands, so a decode row's logits never depend
    # on how its step ran attention (nor, below, on what else its batch held).
    assert torch.equal(got, want)
    # The same k/v written, into this step's slots only (never-written slots may hold NaN).
    torch.testing.assert_close(planned_kv.data, kv.data, rtol=0, atol=0, equal_nan=True)
    written = (planned_kv.data != before).any(-1).any(3)  # [L, 2, blocks, bs]
    slots = meta.slot_mapping.long()
    outside = torch.ones(written.shape[2:], dtype=torch.bool)
    outside[slots // BLOCK, slots % BLOCK] = False
    assert written[:, :, ~outside].all() and not written[:, :, outside].any()


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 16, 17], [20, 20, 20]])
def test_a_planned_decode_step_equals_the_one_shot_ops(quantization, lengths, kernels):
    _assert_planned_equals_one_shot(_model(quantization), lengths, kernels)


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 16, 17]])
def test_over_an_fp8_cache(quantization, lengths, kernels):
    # E4M3 pages with the model's calibrated per-layer scales (not 1: k_scale and v_scale
    # enter the scores and the output where paged_attention applies them)
    model = _model(quantization, kv_cache_dtype="fp8")
    assert all(k != 1.0 and v != 1.0 for k, v in model.kv_scales())
    _assert_planned_equals_one_shot(model, lengths, kernels)


@pytest.mark.parametrize("lengths", [[300], [5, 600, 270]])
def test_across_key_tiles(lengths, kernels):
    _assert_planned_equals_one_shot(_model(), lengths, kernels)
    _assert_planned_equals_one_shot(_model(kv_cache_dtype="fp8"), [3, 520], kernels)


@pytest.mark.parametrize("lengths", [[37], [5, 600, 270]])
def test_the_planned_step_reduces_over_whole_key_tiles(lengths, monkeypatch):
    """As the one-shot op (test_cpu_backend_attention): every scores GEMM spans, and every
    weighted sum reduces over, one whole tile of keys, so a row's bits do not hang on how a
    BLAS blocks a reduction of the batch's longest length."""
    model = _model()
    kv, (ids, meta) = _prefilled(model, lengths)
    spans = record_key_spans(monkeypatch, model.config.head_dim)
    model.hidden_states(ids, meta, kv)
    assert spans and set(spans) == {decode_attention.key_tile(BLOCK)}, sorted(set(spans))


@pytest.mark.parametrize("lengths", [[37], [5, 40, 16, 17]])
def test_a_softmax_scale_not_a_power_of_two(lengths, kernels):
    # head_dim 16 (tiny) and 64 (the default model) fold the scale into q; 32 keeps the
    # multiply on the scores
    model = load_model(PRESETS["tiny"].replace(head_dim=32), "cpu", seed=1)[0]
    _assert_planned_equals_one_shot(model, lengths, kernels)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "bfloat16", "float16"])
def test_decode_rows_beside_a_prefill_chunk(kv_dtype, kernels):
    # The engine's batches mix prefill chunks with decode rows: the decode rows' plan then runs
    # beside the prefill's, bit for bit the one-shot ops on the same batch. (Against a
    # decode-only step the rows agree to rounding only: torch's fp32 GEMM rounds a row apart
    # at 3 rows and at 32, with or without this plan.)
    model = _model(kv_cache_dtype=kv_dtype)
    lengths = [5, 40, 17]
    kv, (ids, meta) = _prefilled(model, lengths)
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    spare = sorted(set(range(1, kv.data.shape[2])) - {b for t in tables for b in t})
    decode_only = model.hidden_states(ids, meta, KVCache(kv.data.clone(), kv.scales))
    prefill = SequenceChunk(list(range(7, 7 + 2 * BLOCK - 3)), 0, spare[:2])
    decode = [SequenceChunk([3 + i], n, t) for i, (n, t) in enumerate(zip(lengths, tables))]
    mixed_ids, mixed = build_batch([prefill, *decode[::-1]], BLOCK)
    assert mixed.num_prefills == 1
    mixed_kv, plain_kv = (KVCache(kv.data.clone(), kv.scales) for _ in range(2))
    got = model.hidden_states(mixed_ids, mixed, mixed_kv)
    (want,) = _one_shot(model, kernels, (mixed_ids, mixed, plain_kv))
    assert not got.isnan().any() and torch.equal(got, want)
    torch.testing.assert_close(mixed_kv.data, plain_kv.data, rtol=0, atol=0, equal_nan=True)
    rows = got[mixed.num_prefill_tokens :].flip(0)
    torch.testing.assert_close(rows, decode_only, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "bfloat16", "float16"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 17], [20, 20, 20]])
def test_the_next_step_reuses_the_copy_bit_for_bit(
    lengths, kv_dtype, gathers, kernels, bookkeeping
):
    # Step 2 appends one token to each of step 1's sequences (same rows, same padded length):
    # it must reuse step 1's copies (one gather a layer for two steps) and still equal the
    # one-shot ops, hidden states and cache writes; after a prefill-only step in between a
    # fresh gather. (fp8: the copy holds what the E4M3 pages read back.)
    model = _model(kv_cache_dtype=kv_dtype)
    layers = model.config.num_layers
    kv, (ids, meta) = _prefilled(model, lengths)
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    planned_kv = KVCache(kv.data.clone(), kv.scales)
    steps = ((ids, meta), _next_step(lengths, tables, 1))
    gathers.clear()
    got = [model.hidden_states(*step, planned_kv) for step in steps]
    assert len(gathers) == layers
    want = _one_shot(model, kernels, *((*step, kv) for step in steps))
    for g, w in zip(got, want, strict=True):
        assert not g.isnan().any() and torch.equal(g, w)
    torch.testing.assert_close(planned_kv.data, kv.data, rtol=0, atol=0, equal_nan=True)
    spare = sorted(set(range(1, kv.data.shape[2])) - {b for t in tables for b in t})
    prefill = build_batch([SequenceChunk([1, 2, 3], 0, spare[:1])], BLOCK)
    model.hidden_states(*prefill, planned_kv)  # a step without decode rows
    step3 = _next_step(lengths, tables, 2)
    gathers.clear()
    got = model.hidden_states(*step3, planned_kv)
    assert len(gathers) == layers
    (want,) = _one_shot(model, kernels, (*step3, kv))
    assert torch.equal(got, want)


def test_a_sequence_that_starts_a_block_keeps_the_copy(gathers, kernels, bookkeeping):
    # Staggered lengths (the common batch): at step 2 the second sequence's token is the first
    # of a block its table gains only now; the longest stays within its last block, so the
    # padded length is the same and step 1's copy is reused, bit for bit the one-shot ops. A
    # block id changed where the copy had read (a table rewritten) is gathered afresh.
    model = _model()
    layers = model.config.num_layers
    lengths = [5, 31, 40]
    kv, (ids, meta) = _prefilled(model, lengths)
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    assert len(tables[1]) == 2  # position 31: the last slot of its second block
    spare = sorted(set(range(1, kv.data.shape[2])) - {b for t in tables for b in t})
    grown = [tables[0], tables[1] + [spare[0]], tables[2]]
    step2 = _next_step(lengths, grown, 1)
    moved = [tables[0], [spare[1], *grown[1][1:]], tables[2]]  # its first block replaced
    step2_moved = _next_step(lengths, moved, 1)
    for second, want_gathers in ((step2, layers), (step2_moved, 2 * layers)):
        gathers.clear()
        planned_kv, plain_kv = KVCache(kv.data.clone()), KVCache(kv.data.clone())
        got = [model.hidden_states(*step, planned_kv) for step in ((ids, meta), second)]
        assert len(gathers) == want_gathers
        want = _one_shot(model, kernels, *((*step, plain_kv) for step in ((ids, meta), second)))
        for g, w in zip(got, want, strict=True):
            assert not g.isnan().any() and torch.equal(g, w)
        torch.testing.assert_close(planned_kv.data, plain_kv.data, rtol=0, atol=0, equal_nan=True)


def test_rows_in_another_order_are_gathered_afresh(gathers, kernels, bookkeeping):
    # Each sequence one token on, but row i now holds another sequence (same lengths): the
    # last copy's rows are other sequences' K/V.
    model = _model()
    kv, step1 = _prefilled(model, [20, 20, 20])
    tables = [t[t > 0].tolist() for t in step1[1].block_tables]
    step2 = build_batch([SequenceChunk([7], 21, t) for t in tables[1:] + tables[:1]], BLOCK)
    plain_kv = KVCache(kv.data.clone())
    model.hidden_states(*step1, kv)
    gathers.clear()
    got = model.hidden_states(*step2, kv)
    assert len(gathers) == model.config.num_layers
    want = _one_shot(model, kernels, (*step1, plain_kv), (*step2, plain_kv))[1]
    assert torch.equal(got, want)


@pytest.mark.parametrize("other", [False, True])
def test_verification_rows_of_one_sequence_see_each_others_new_kv(other, kernels, bookkeeping):
    # Speculative verification lays 1 + k tokens of one sequence out as decode rows that share
    # its block table; row j reads rows < j's new K/V. The result is the causal chunk's (beside
    # another sequence's decode row when `other`), and the one-shot ops' bit for bit.
    model = _model()
    kv, (_, meta) = _prefilled(model, [21, 9])
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    chunk = SequenceChunk([5, 6, 7, 8], 21, tables[0])
    rows = verification_rows(chunk)
    extra = [SequenceChunk([4], 9, tables[1])] if other else []
    ids, meta = build_batch(rows + extra, BLOCK)
    assert meta.num_prefills == 0
    got_kv = KVCache(kv.data.clone())
    got = model.hidden_states(ids, meta, got_kv)[: len(rows)]
    chunk_ids, chunk_meta = build_batch([chunk], BLOCK)
    want_kv = KVCache(kv.data.clone())
    want = model.hidden_states(chunk_ids, chunk_meta, want_kv)
    plain_kv = KVCache(kv.data.clone())
    (plain,) = _one_shot(model, kernels, (ids, meta, plain_kv))
    assert not got.isnan().any()
    assert torch.equal(got, plain[: len(rows)])
    torch.testing.assert_close(got_kv.data, plain_kv.data, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(got_kv.data[:, :, tables[0]], want_kv.data[:, :, tables[0]])


def test_the_reference_backend_runs_the_reference_ops(gathers):
    model = _model()
    kv, (ids, meta) = _prefilled(model, [9, 4])
    with ops.use_backend("reference"):
        model.hidden_states(ids, meta, kv)
    assert not gathers
