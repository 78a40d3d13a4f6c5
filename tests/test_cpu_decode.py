"""The CPU decode fast path (model/cpu_decode.py) against the plain forward it replaces: the
same hidden states and KV-cache writes bit for bit, for fp32, int8 and int4 weights, one
sequence, equal and unequal lengths, speculative verification rows; and the batches it must
leave to the plain path."""

from __future__ import annotations

import pytest
import torch

from pagedkern.model import PRESETS, SequenceChunk, build_batch, cpu_decode, load_model
from pagedkern.model.attention_metadata import verification_rows
from pagedkern.model.kv_cache import KVCache

BLOCK = 16


def _model(quantization: str):
    model, _ = load_model("synthetic:tiny", quantization=quantization)
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


@pytest.fixture
def gathers(monkeypatch) -> list[int]:
    """One entry per fresh gather of the fast path's K/V copy."""
    counted: list[int] = []
    gather = cpu_decode.gather_decode_kv
    monkeypatch.setattr(cpu_decode, "gather_decode_kv", lambda *a: counted.append(1) or gather(*a))
    return counted


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 16, 17], [20, 20, 20]])
def test_fast_decode_step_equals_plain(quantization, lengths):
    _assert_fast_equals_plain(_model(quantization), lengths)


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 16, 17], [20, 20, 20]])
def test_fast_decode_step_equals_plain_over_an_fp8_cache(quantization, lengths):
    # E4M3 pages with the model's calibrated per-layer scales (not 1: k_scale and v_scale
    # enter the scores and the output where paged_attention applies them)
    model, _ = load_model("synthetic:tiny", quantization=quantization, kv_cache_dtype="fp8")
    assert all(k != 1.0 and v != 1.0 for k, v in model.kv_scales())
    _assert_fast_equals_plain(model, lengths)


@pytest.mark.parametrize("lengths", [[37], [5, 40, 16, 17]])
def test_fast_decode_step_equals_plain_with_a_softmax_scale_not_a_power_of_two(lengths):
    # head_dim 16 (tiny) and 64 (the default model) fold the scale into q's RoPE rows; 32 keeps
    # the multiply on the scores
    model = load_model(PRESETS["tiny"].replace(head_dim=32), "cpu", seed=1)[0]
    _assert_fast_equals_plain(model, lengths)


def _assert_fast_equals_plain(model, lengths: list[int]) -> None:
    kv, (ids, meta) = _prefilled(model, lengths)
    before = kv.data.clone()
    fast_kv = KVCache(kv.data.clone(), kv.scales)
    model.fast_cpu_decode = False
    plain = model.hidden_states(ids, meta, kv)
    model.fast_cpu_decode = True
    assert cpu_decode.applies(model, meta, fast_kv)
    fast = model.hidden_states(ids, meta, fast_kv)
    assert fast.dtype == plain.dtype == torch.float32 and not fast.isnan().any()
    # Bit for bit: the same ops in the same order with the same rounding points, so a decode
    # row's logits never depend on which path its step took (i.e. on the batch make-up).
    assert torch.equal(fast, plain)
    # The same k/v written, into this step's slots only (never-written slots may hold NaN).
    torch.testing.assert_close(fast_kv.data, kv.data, rtol=0, atol=0, equal_nan=True)
    written = (fast_kv.data != before).any(-1).any(3)  # [L, 2, blocks, bs]
    slots = meta.slot_mapping.long()
    outside = torch.ones(written.shape[2:], dtype=torch.bool)
    outside[slots // BLOCK, slots % BLOCK] = False
    assert written[:, :, ~outside].all() and not written[:, :, outside].any()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 17], [20, 20, 20]])
def test_the_next_step_reuses_the_gathered_copy_bit_for_bit(lengths, kv_dtype, gathers):
    # Step 2 appends one token to each of step 1's sequences (same rows, same padded length):
    # it must reuse step 1's gathered copy (one gather for two steps) and still equal the plain
    # path, hidden states and cache writes; after a plain step in between (the sequences moved on
    # without the copy) a fresh gather. (fp8: the copy holds what the E4M3 pages read back.)
    model, _ = load_model("synthetic:tiny", kv_cache_dtype=kv_dtype)
    kv, (ids, meta) = _prefilled(model, lengths)
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    fast_kv = KVCache(kv.data.clone(), kv.scales)
    steps = ((ids, meta), _next_step(lengths, tables, 1))
    model.fast_cpu_decode = True
    fast = [model.hidden_states(*step, fast_kv) for step in steps]
    assert len(gathers) == 1
    model.fast_cpu_decode = False
    plain = [model.hidden_states(*step, kv) for step in steps]
    for got, want in zip(fast, plain, strict=True):
        assert not got.isnan().any() and torch.equal(got, want)
    torch.testing.assert_close(fast_kv.data, kv.data, rtol=0, atol=0, equal_nan=True)
    step3, step4 = (_next_step(lengths, tables, k) for k in (2, 3))
    model.hidden_states(*step3, fast_kv)  # a plain step
    assert model._cpu_decode_kv is None  # (the copy's memory given back)
    model.hidden_states(*step3, kv)
    model.fast_cpu_decode = True
    fast = model.hidden_states(*step4, fast_kv)
    assert len(gathers) == 2
    model.fast_cpu_decode = False
    assert torch.equal(fast, model.hidden_states(*step4, kv))


def test_a_sequence_that_starts_a_block_keeps_the_copy(gathers):
    # Staggered lengths (the common batch): at step 2 the second sequence's token is the first
    # of a block its table gains only now; the longest stays within its last block, so the
    # padded length is the same and step 1's copy is reused, bit for bit the plain path. A block
    # id changed where the copy had read (a table rewritten) is gathered afresh.
    model = _model("none")
    lengths = [5, 31, 40]
    kv, (ids, meta) = _prefilled(model, lengths)
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    assert len(tables[1]) == 2  # position 31: the last slot of its second block
    spare = sorted(set(range(1, kv.data.shape[2])) - {b for t in tables for b in t})
    grown = [tables[0], tables[1] + [spare[0]], tables[2]]
    step2 = _next_step(lengths, grown, 1)
    moved = [tables[0], [spare[1], *grown[1][1:]], tables[2]]  # its first block replaced
    step2_moved = _next_step(lengths, moved, 1)
    for second, want_gathers in ((step2, 1), (step2_moved, 2)):
        gathers.clear()
        fast_kv, plain_kv = KVCache(kv.data.clone()), KVCache(kv.data.clone())
        model.fast_cpu_decode = True
        fast = [model.hidden_states(*step, fast_kv) for step in ((ids, meta), second)]
        assert len(gathers) == want_gathers
        model.fast_cpu_decode = False
        plain = [model.hidden_states(*step, plain_kv) for step in ((ids, meta), second)]
        for got, want in zip(fast, plain, strict=True):
            assert not got.isnan().any() and torch.equal(got, want)
        torch.testing.assert_close(fast_kv.data, plain_kv.data, rtol=0, atol=0, equal_nan=True)


def test_rows_in_another_order_are_gathered_afresh(gathers):
    # Each sequence one token on, but row i now holds another sequence (same lengths): the
    # last copy's rows are other sequences' K/V.
    model = _model("none")
    model.fast_cpu_decode = True
    kv, step1 = _prefilled(model, [20, 20, 20])
    tables = [t[t > 0].tolist() for t in step1[1].block_tables]
    step2 = build_batch([SequenceChunk([7], 21, t) for t in tables[1:] + tables[:1]], BLOCK)
    plain_kv = KVCache(kv.data.clone())
    model.hidden_states(*step1, kv)
    fast = model.hidden_states(*step2, kv)
    assert len(gathers) == 2
    model.fast_cpu_decode = False
    model.hidden_states(*step1, plain_kv)
    assert torch.equal(fast, model.hidden_states(*step2, plain_kv))


def test_plain_path_for_prefill_and_calibration():
    model = _model("none")
    kv, (ids, meta) = _prefilled(model, [9, 4])
    assert cpu_decode.applies(model, meta, kv)
    prefill_ids, prefill = build_batch([SequenceChunk([1, 2, 3], 0, [1])], BLOCK)
    assert not cpu_decode.applies(model, prefill, kv)  # a prefill row
    model._kv_amax = []  # fp8 calibration collects |k|, |v| on the plain path
    assert not cpu_decode.applies(model, meta, kv)


@pytest.mark.parametrize("other", [False, True])
def test_verification_rows_of_one_sequence_see_each_others_new_kv(other):
    # Speculative verification lays 1 + k tokens of one sequence out as decode rows that share
    # its block table; row j reads rows < j's new K/V, which the fast path writes to the cache
    # only after the last layer: it must put them into row j's gathered copy itself. The result
    # is the causal chunk's (beside another sequence's plain decode row when `other`).
    model = _model("none")
    model.fast_cpu_decode = True
    kv, (_, meta) = _prefilled(model, [21, 9])
    tables = [t[t > 0].tolist() for t in meta.block_tables]
    chunk = SequenceChunk([5, 6, 7, 8], 21, tables[0])
    rows = verification_rows(chunk)
    extra = [SequenceChunk([4], 9, tables[1])] if other else []
    ids, meta = build_batch(rows + extra, BLOCK)
    assert meta.num_prefills == 0 and cpu_decode.applies(model, meta, kv)
    got_kv = KVCache(kv.data.clone())
    got = model.hidden_states(ids, meta, got_kv)[: len(rows)]
    model.fast_cpu_decode = False
    chunk_ids, chunk_meta = build_batch([chunk], BLOCK)
    want_kv = KVCache(kv.data.clone())
    want = model.hidden_states(chunk_ids, chunk_meta, want_kv)
    plain_kv = KVCache(kv.data.clone())
    plain = model.hidden_states(ids, meta, plain_kv)[: len(rows)]  # the same rows, plain path
    assert not got.isnan().any()
    assert torch.equal(got, plain)
    torch.testing.assert_close(got_kv.data, plain_kv.data, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(got_kv.data[:, :, tables[0]], want_kv.data[:, :, tables[0]])


def test_on_by_default_and_the_flag_turns_it_off():
    from pagedkern.engine import Engine, EngineConfig
    from pagedkern.serving.cli import args as cli_args

    def config(*flags: str) -> EngineConfig:
        return cli_args.engine_config(cli_args.build_parser().parse_args([*flags, "hi"]))

    assert config().cpu_fast_decode is True
    assert config("--no-cpu-fast-decode").cpu_fast_decode is False
    engine = Engine.from_config(EngineConfig(model="synthetic:tiny", backend="reference"))
    assert engine.model.fast_cpu_decode is True
