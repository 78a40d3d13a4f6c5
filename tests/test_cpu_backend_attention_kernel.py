"""The CPU attention kernel (csrc/cpu/attention.cpp via ops/cpu/attention_kernel.py) on its own:
against the reference over odd shapes (head sizes with a partial P.V pass, block sizes of 1 and
5, windows, soft-cap, sinks, bf16 / fp16 / fp8 caches, strided q rows, bf16 q and out) with
NaN-poisoned caches and outputs; every path it runs gives the same bits, as does any thread
count; a row is the same bits in a chunk, as a decode row and beside other rows, blocks of rows
cut short by a long context included; bad arguments are refused before anything is written;
and a model's step runs it once a layer, for prefill and decode rows alike."""

from __future__ import annotations

import pytest
import torch
from kernel_check import assert_close_to, poisoned
from test_cpu_backend_attention import _paged

from pagedkern import ops, reference
from pagedkern.model import SequenceChunk, build_batch, load_model
from pagedkern.model.kv_cache import KVCache
from pagedkern.ops.cpu import attention_kernel, quant_gemv

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")
PATHS = [p for p in attention_kernel.PATHS if attention_kernel.path_supported(p)]


def _case(seed, chunks, seq_lens, hq=6, hkv=2, d=64, block_size=16, dtype=torch.float32):
    """Random q for query chunks (the last positions before each length) over poisoned caches."""
    g = torch.Generator().manual_seed(seed)
    k, v, tables = _paged(seq_lens, hkv, block_size, dtype, g, d)
    q = torch.randn(sum(chunks), hq, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, tables, torch.tensor(seq_lens, dtype=torch.int32)


def _attend(q, k, v, cu, tables, lens, path=None, out=None, lse=None, **options):
    rows = attention_kernel.chunk_rows(cu, lens, q.shape[0])
    out = poisoned(q.shape, torch.float32, "cpu") if out is None else out
    scale = options.pop("scale", q.shape[2] ** -0.5)
    attention_kernel.attend(q, k, v, tables, *rows, out, scale=scale, lse=lse, path=path, **options)
    return out


OPTIONS = [
    {},
    {"sliding_window": 9},
    {"soft_cap": 4.0},
    {"sinks": "random"},
    {"sliding_window": 30, "soft_cap": 10.0, "sinks": "random"},
]


def _options(options, hq, seed=0):
    if options.get("sinks") == "random":
        sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed))
        return {**options, "sinks": sinks}
    return dict(options)


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "soft_cap", "sinks", "all"])
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,dtype",
    [
        (6, 2, 64, 16, torch.float32),
        (5, 5, 72, 5, torch.float32),  # a partial P.V pass (72 = 64 + 8), odd block size
        (8, 1, 200, 1, torch.bfloat16),  # 200 = 3 x 64 + 8, one slot a block, bf16 pages
        (4, 2, 8, 7, torch.bfloat16),
        (6, 3, 64, 16, torch.float16),
        (6, 2, 64, 16, torch.float8_e4m3fn),  # (no scales: a plain E4M3 cache)
    ],
)
def test_matches_the_reference(options, hq, hkv, d, block_size, dtype):
    chunks, lens = [37, 1, 1, 90], [37, 300, 1, 150]
    q, k, v, cu, tables, seq_lens = _case(1, chunks, lens, hq, hkv, d, block_size, dtype)
    options = _options(options, hq)
    want, want_lse = reference.flash_prefill(
        q, k, v, cu, tables, seq_lens, return_lse=True, **options
    )
    lse = poisoned((q.shape[0], hq), torch.float32, "cpu")
    got = _attend(q, k, v, cu, tables, seq_lens, lse=lse, **options)
    assert_close_to(got, want, torch.float32)
    assert_close_to(lse, want_lse, torch.float32)


@pytest.mark.parametrize(
    "hq,hkv,d,block_size",
    [
        (6, 2, 64, 16),  # GQA 3: blocks of rows start at odd rows
        (16, 8, 128, 16),  # Qwen3's heads
        (8, 1, 72, 5),  # GQA 8; a 64-lane P.V pass and 8 lanes
        (4, 4, 136, 16),  # no GQA; two 64-lane passes and 8 lanes
        (15, 5, 40, 8),  # 32 + 8 lanes
        (2, 1, 8, 3),  # one 8-lane chunk a key
    ],
)
def test_every_path_gives_the_same_bits(hq, hkv, d, block_size):
    """Paths that group rows and lanes differently (AVX-512: two rows a register, up to six
    rows a pass) compute each row's operations alike."""
    if len(PATHS) < 2:
        pytest.skip(f"this CPU runs only {PATHS}")
    for seed, options in enumerate(OPTIONS):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            q, k, v, cu, tables, lens = _case(
                seed, [50, 1, 3, 17], [50, 700, 260, 140], hq, hkv, d, block_size, dtype
            )
            options_ = _options(options, hq, seed)
            results = []
            for path in PATHS:
                lse = poisoned((q.shape[0], hq), torch.float32, "cpu")
                out = _attend(q, k, v, cu, tables, lens, path=path, lse=lse, **options_)
                results.append((out, lse))
            assert not results[0][0].isnan().any()
            for out, lse in results[1:]:
                assert torch.equal(out, results[0][0]), (options, dtype)
                assert torch.equal(lse, results[0][1]), (options, dtype)


def test_the_thread_count_changes_no_bit():
    q, k, v, cu, tables, lens = _case(3, [200, 1, 1, 1], [400, 90, 700, 5])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(q, k, v, cu, tables, lens)
        torch.set_num_threads(max(2, threads))
        many = _attend(q, k, v, cu, tables, lens)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("window", [None, 50])
def test_a_row_is_the_same_bits_in_a_chunk_as_a_decode_row_and_in_a_batch(window):
    """Past ~22k keys (GQA group 3) a block holds fewer than 16 positions (its scores stay
    within a budget): the rows stay the same bits."""
    n = 23000
    q, k, v, cu, tables, lens = _case(4, [n], [n], hq=3, hkv=1, block_size=16)
    options = {} if window is None else {"sliding_window": window}
    positions = [0, 7, 8, 255, 9000, 22990, n - 1]
    chunk = 40
    for p in positions:
        first = max(0, p - chunk + 1)
        rows = q[first : p + 1]
        in_chunk = _attend(
            rows, k, v, torch.tensor([0, rows.shape[0]], dtype=torch.int32), tables,
            torch.tensor([p + 1], dtype=torch.int32), **options,
        )  # fmt: skip
        decode = _attend(
            q[p : p + 1].repeat(3, 1, 1), k, v, torch.tensor([0, 1, 2, 3], dtype=torch.int32),
            tables.repeat(3, 1), torch.tensor([p + 1, n, 17], dtype=torch.int32), **options,
        )  # fmt: skip
        assert torch.equal(decode[0], in_chunk[-1]), p
    want = reference.paged_attention(
        q[-1:], k, v, tables, torch.tensor([n], dtype=torch.int32), **options
    )
    assert_close_to(decode[1:2], want, torch.float32)


def test_strided_q_rows_and_bf16_q_and_out():
    q, k, v, cu, tables, lens = _case(5, [20, 1], [40, 33])
    wide = torch.randn(q.shape[0], 9, 64)
    wide[:, 2:8] = q  # q as a view of wider rows (a fused QKV output)
    strided = wide[:, 2:8]
    want = reference.flash_prefill(q, k, v, cu, tables, lens)
    assert_close_to(_attend(strided, k, v, cu, tables, lens), want, torch.float32)
    out = poisoned(q.shape, torch.bfloat16, "cpu")
    _attend(q.bfloat16(), k, v, cu, tables, lens, out=out)
    want = reference.flash_prefill(q.bfloat16(), k, v, cu, tables, lens)
    assert_close_to(out, want, torch.bfloat16)


def test_rows_with_no_key_are_zero():
    q, k, v, cu, tables, lens = _case(6, [1, 1], [20, 20])
    out = poisoned(q.shape, torch.float32, "cpu")
    lse = poisoned((2, 6), torch.float32, "cpu")
    attention_kernel.attend(
        q, k, v, tables, torch.tensor([0, 1]), torch.tensor([-1, 19]), out, scale=0.125, lse=lse
    )
    assert torch.equal(out[0], torch.zeros(6, 64)) and torch.isneginf(lse[0]).all()
    assert not out[1].isnan().any()


@pytest.mark.parametrize(
    "change,error,match",
    [
        ("seq", IndexError, "outside the 2 block tables"),
        ("position", IndexError, "past its block table"),
        ("block", IndexError, "outside the cache"),
        ("head_size", ValueError, "multiple of 8"),
        ("cache_dtype", ValueError, "float32, bfloat16"),
        ("rows", ValueError, "row_seq"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(change, error, match):
    q, k, v, cu, tables, lens = _case(7, [1, 1], [20, 40])
    seqs, positions = torch.tensor([0, 1]), lens - 1
    if change == "seq":
        seqs = torch.tensor([0, 2])
    elif change == "position":
        positions = torch.tensor([19, tables.shape[1] * 16])
    elif change == "block":
        tables = tables.clone()
        tables[1, 1] = k.shape[0]
    elif change == "head_size":
        q, k, v = q[..., :12], k[..., :12].contiguous(), v[..., :12].contiguous()
    elif change == "cache_dtype":
        k, v = k.double(), v.double()
    elif change == "rows":
        seqs = torch.tensor([0])
    out = poisoned(q.shape, torch.float32, "cpu")
    with pytest.raises(error, match=match):
        attention_kernel.attend(q, k, v, tables, seqs, positions, out, scale=0.125)
    assert out.isnan().all()


def test_a_head_size_it_declines_runs_the_tiles():
    q, k, v, cu, tables, lens = _case(8, [30], [30], d=12)
    assert not attention_kernel.applies(k, 12)
    assert attention_kernel.applies(k.bfloat16(), 64)
    assert attention_kernel.applies(k.to(torch.float8_e4m3fn), 64)
    with ops.use_backend("cpu"):
        got = ops.flash_prefill(q, k, v, cu, tables, lens)
    assert_close_to(got, reference.flash_prefill(q, k, v, cu, tables, lens), torch.float32)


def test_a_step_runs_it_once_a_layer_for_prefill_and_decode_rows(monkeypatch, kernels):
    """A mixed step (a prefill chunk beside a decode row): one kernel call a layer over all 71
    rows, and the same bits as the one-shot ops (attention_plan:off) and the same k/v written."""
    model, _ = load_model("synthetic:tiny")
    g = torch.Generator().manual_seed(9)
    kv = model.allocate_kv_cache(16, 16)
    with ops.use_backend("cpu"):
        ids = torch.randint(0, model.config.vocab_size, (30,), generator=g).tolist()
        model.hidden_states(*build_batch([SequenceChunk(ids, 0, [1, 2])], 16), kv)
        prompt = torch.randint(0, model.config.vocab_size, (70,), generator=g).tolist()
        ids, meta = build_batch(
            [SequenceChunk(prompt, 0, [3, 4, 5, 6, 7]), SequenceChunk([11], 30, [1, 2])], 16
        )
        calls = []
        module = quant_gemv.cpu_module()
        real = module.attention
        monkeypatch.setattr(
            module, "attention", lambda **kw: calls.append(kw["rows"]) or real(**kw)
        )
        planned_kv = KVCache(kv.data.clone(), kv.scales)
        got = model.hidden_states(ids, meta, planned_kv)
        assert calls == [71] * model.config.num_layers
        kernels(attention_plan="off")
        want = model.hidden_states(ids, meta, kv)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    torch.testing.assert_close(planned_kv.data, kv.data, rtol=0, atol=0, equal_nan=True)


def test_chunk_rows_are_each_chunks_last_positions():
    """Chunk b's rows sit at the last positions before seq_lens[b]; rows past the last chunk see
    no key; bounds that do not rise from 0 within the rows are refused."""
    cu = torch.tensor([0, 3, 4, 4, 6], dtype=torch.int32)
    lens = torch.tensor([10, 1, 5, 7], dtype=torch.int32)
    seq, pos = attention_kernel.chunk_rows(cu, lens, 8)
    assert seq.tolist() == [0, 0, 0, 1, 3, 3, 0, 0]
    assert pos.tolist() == [7, 8, 9, 0, 5, 6, -1, -1]
    for bad in ([1, 3, 4, 4, 6], [0, 3, 2, 4, 6], [0, 3, 4, 4, 9]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            attention_kernel.chunk_rows(torch.tensor(bad, dtype=torch.int32), lens, 8)
