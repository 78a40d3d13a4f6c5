"""Per-kind block tables for hybrid local/global models (model/kv_cache.py KVLayerGroups,
engine/hybrid_tables.py): the layer grouping, the tables' reserve / release / prefix-hit rule on
the pool directly, then through the engine with the tiny Gemma 2 and Gemma 3 of
test_model_gemma (a window of 6 against 20-token prompts): greedy tokens and logprobs equal
with and without per-kind tables and equal to transformers', through chunked prefill,
asynchronous scheduling, prefix-cache hits (also on sliding blocks evicted meanwhile) and
preemption, while the sliding groups hold a window's worth of blocks per sequence."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import write_tokenizer
from test_model_gemma import PROMPT, WINDOW, _hf_model
from transformers_oracle import (
    assert_logprobs_follow,
    assert_preemption_and_batching_change_nothing,
    hf_greedy,
)

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.block_pool import BlockPool
from pagedkern.engine.hybrid_tables import HybridTables, group_key
from pagedkern.engine.kv_budget import context_that_fits
from pagedkern.engine.request import Request
from pagedkern.model.config import FULL, SLIDING, ModelConfig
from pagedkern.model.kv_cache import kv_block_bytes, kv_layer_groups

transformers = pytest.importorskip("transformers")
BLOCK = 4


def _config(types, window=6):
    return ModelConfig(
        name="t", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=len(types),
        num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=window, layer_types=types,
    )  # fmt: skip


def test_layers_are_grouped_by_kind_into_equal_groups():
    s, f = SLIDING, FULL
    gemma3 = kv_layer_groups(_config((s, s, s, s, s, f) * 2))  # 5:1: groups of 2 layers
    assert gemma3.windows == (None,) + (6,) * 5
    assert gemma3.num_slots == 2
    assert gemma3.layer_group == (1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 0)
    assert gemma3.layer_slot == (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1)
    gemma2 = kv_layer_groups(_config((s, f) * 3))
    assert gemma2.windows == (None, 6) and gemma2.num_slots == 3
    odd = kv_layer_groups(_config((s, s, s, f, f)))  # 3 sliding over groups of 2: one padded
    assert odd.windows == (None, 6, 6) and odd.layer_group == (1, 1, 2, 0, 0)
    assert kv_layer_groups(_config((s, s))) is None  # one kind: the plain layout
    assert kv_layer_groups(_config((f, f), None)) is None
    # a block spans one group's 2 slots: a sixth of the plain block (12 layers)
    plain = kv_block_bytes(_config((s, s, s, s, s, f) * 2), BLOCK, torch.float32)
    assert kv_block_bytes(_config((f,) * 12), BLOCK, torch.float32, gemma3) * 6 == plain


def _tables(num_blocks=40, caching=True):
    pool = BlockPool(num_blocks, BLOCK, caching, reserve_null_block=True)
    return HybridTables(pool, (None, 6, 6), chunk=8)


def _run(tables: HybridTables, request: Request, upto: int, chunk: int = 8) -> None:
    """Feed the request's ids up to `upto` as the scheduler does: reserve, count, register
    the blocks that filled, release outside the window."""
    pool = tables.pool
    while request.num_computed_tokens < upto:
        before = request.num_computed_tokens
        after = min(upto, before + chunk)
        assert tables.reserve(request, pool.blocks_for(after))
        request.num_computed_tokens = after
        request.block_hashes = pool.block_hashes(request.all_ids[:after], request.block_hashes)
        tables.register(request, before // BLOCK, after // BLOCK)
        tables.release_outside_window(request, after)
        pool.check_invariants(tables.all_tables([request]))


def test_sliding_groups_hold_the_window_and_full_groups_everything():
    tables = _tables()
    pool, null = tables.pool, tables.pool.null_block
    request = Request("r", tuple(range(100, 130)), SamplingParams(max_tokens=4))
    _run(tables, request, 30)
    full, *sliding = tables.tables(request)
    assert len(full) == 8 and null not in full
    # the next query at 30 sees keys 25..30: blocks 6 and 7 (tokens 24..31) stay
    for table in sliding:
        assert table[:6] == [null] * 6 and null not in table[6:]
    assert pool.used_by_kind == [8, 4] and pool.peak_by_kind[1] <= 2 * 4
    tables.roll_back(request, 7)
    assert all(len(t) == 7 for t in tables.tables(request))
    tables.release(request)
    assert request.block_table == [] and pool.num_free == pool.num_blocks
    assert pool.used_by_kind == [0, 0]
    pool.check_invariants([])


def test_a_prefix_hit_needs_every_full_block_and_the_windows_blocks():
    tables = _tables()
    pool, null = tables.pool, tables.pool.null_block
    ids = tuple(range(200, 230))
    first = Request("a", ids, SamplingParams(max_tokens=4))
    _run(tables, first, 30)
    tables.release(first)  # every block free, still cached (the sliding ones too)
    again = Request("b", ids, SamplingParams(max_tokens=4))
    again.block_hashes = pool.block_hashes(ids)
    acquired, hit = tables.prefix_hits(again, 7)
    assert hit == 7  # 28 tokens: the next query at 28 sees 23..28, blocks 5 and 6
    assert again.block_table == [pool.cached_block(h) for h in again.block_hashes[:7]]
    for g, table in enumerate(again.group_tables, start=1):
        assert table[:5] == [null] * 5
        assert table[5:] == [pool.cached_block(group_key(h, g)) for h in again.block_hashes[5:7]]
    assert len(acquired) == 7 + 2 * 2
    pool.check_invariants(tables.all_tables([again]))
    tables.release(again)
    pool.check_invariants([])


def test_a_hit_is_shortened_to_where_the_sliding_blocks_are_still_cached():
    tables = _tables()
    pool = tables.pool
    ids = tuple(range(300, 330))
    first = Request("a", ids, SamplingParams(max_tokens=4))
    _run(tables, first, 30)
    hashes = pool.block_hashes(ids)
    # the released sliding blocks 0..5 are free and cached, 6 and 7 still held. Evict group
    # 1's block 5 alone (put first in the eviction order, then allocated: its hash goes)
    victim = pool.cached_block(group_key(hashes[5], 1))
    pool._free.move_to_end(victim, last=False)
    assert pool.allocate(1) == [victim] and pool.cached_block(group_key(hashes[5], 1)) is None
    pool.free([victim])
    second = Request("b", ids, SamplingParams(max_tokens=4))
    second.block_hashes = list(hashes)
    _, hit = tables.prefix_hits(second, 7)
    # a hit of h blocks needs each sliding group's blocks [(4h - 5) // 4, h): h = 7 and 6
    # need group 1's block 5; h = 5 needs blocks 3 and 4, cached
    assert hit == 5
    assert second.group_tables[0][:3] == [pool.null_block] * 3
    assert second.group_tables[0][3:] == [pool.cached_block(group_key(h, 1)) for h in hashes[3:5]]
    pool.check_invariants(tables.all_tables([first, second]))
    tables.release(second)
    tables.release(first)
    pool.check_invariants([])


def test_without_prefix_caching_nothing_is_found():
    tables = _tables(caching=False)
    ids = tuple(range(30))
    first = Request("a", ids, SamplingParams(max_tokens=4))
    _run(tables, first, 30)
    second = Request("b", ids, SamplingParams(max_tokens=4))
    second.block_hashes = tables.pool.block_hashes(ids)
    assert tables.prefix_hits(second, 7) == ([], 0)


def test_the_budget_holds_more_blocks_and_the_context_fits_them():
    s, f = SLIDING, FULL
    config = _config((s, s, s, s, s, f) * 2)
    groups = kv_layer_groups(config)
    # 6 groups over one pool: a sequence of 32 tokens holds 8 full blocks and, per sliding
    # group, at most (6 + 2 * 8 - 2) // 4 + 2 = 7
    assert groups.blocks_for(32, BLOCK, 16) == 8 + 5 * 7
    assert context_that_fits(groups, 8 + 5 * 7, BLOCK, 8, 1000) == 32
    assert context_that_fits(groups, 8 + 5 * 7 - 1, BLOCK, 8, 1000) == 28
    assert context_that_fits(groups, 10**6, BLOCK, 8, 1000) == 1000


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def saved(request, tmp_path_factory):
    model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder, model


def _engine(folder, **args) -> Engine:
    config = dict(
        model=str(folder), backend="reference", dtype="float32", kv_cache_dtype="float32",
        block_size=BLOCK,
    )  # fmt: skip
    return Engine.from_config(EngineConfig(**{**config, "num_blocks": 96, **args}))


def _greedy(engine: Engine, prompts, steps):
    """(outputs per prompt, as token and logprobs pairs; every step's invariants checked)."""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=1)
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    got: dict[str, list] = {r.request_id: [] for r in requests}
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for output in engine.step():
            got[output.request_id] += [(t, output.logprobs) for t in output.token_ids]
            outputs[output.request_id].append(output)
        engine.pool.check_invariants(engine.scheduler.block_tables())
    return [got[r.request_id] for r in requests], [outputs[r.request_id] for r in requests]


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"max_num_batched_tokens": 8},
        {"max_num_batched_tokens": 8, "async_scheduling": True},
        {"max_num_batched_tokens": 8, "cuda_graphs": True},  # (on the CPU: static buffers)
    ],
    ids=["whole prefill", "chunked prefill", "chunked asynchronous", "graph buffers"],
)
def test_per_kind_tables_change_no_token_or_logprob(saved, args, monkeypatch):
    from pagedkern.engine.cuda_graphs import DecodeGraphs
    from pagedkern.engine.piecewise_graphs import PiecewiseGraphs

    folder, hf = saved
    steps = 24
    prompts = [PROMPT, PROMPT[7:] + PROMPT[:7]]
    engine = _engine(folder, **args)
    assert engine.scheduler.hybrid is not None and engine.kv_cache.groups is not None
    runs = []
    if args.get("cuda_graphs"):  # both static-buffer paths run the per-kind tables
        assert engine.runner.graphs.num_groups == engine.runner.piecewise.num_groups > 0
        for cls in (DecodeGraphs, PiecewiseGraphs):
            run = cls.run
            monkeypatch.setattr(
                cls, "run", lambda s, lay, r=run, c=cls: runs.append(c) or r(s, lay)
            )
    per_kind, outputs = _greedy(engine, prompts, steps)
    assert set(runs) == ({DecodeGraphs, PiecewiseGraphs} if args.get("cuda_graphs") else set())
    one_table, _ = _greedy(_engine(folder, kv_per_kind_tables=False, **args), prompts, steps)
    assert per_kind == one_table
    want_tokens, want_logits = hf_greedy(hf, PROMPT, steps)
    assert_logprobs_follow(outputs[0], want_tokens, want_logits)
    # 44 tokens: 11 blocks per sequence in every full group; a sliding group holds the window
    # (6) and the block being filled: at most 3 blocks at a decode, and a chunk's worth more
    # while a prompt is fed (two chunks in flight under asynchronous scheduling)
    groups = engine.kv_cache.groups
    num_sliding = sum(w is not None for w in groups.windows)
    chunk = args.get("max_num_batched_tokens", len(PROMPT)) * (2 if args else 1)
    bound = 2 * num_sliding * ((WINDOW + chunk - 2) // BLOCK + 2)
    used, peak = engine.pool.used_by_kind, engine.pool.peak_by_kind
    assert used == [0, 0] and peak[1] <= bound
    assert peak[0] >= 2 * (groups.num_groups - num_sliding) * 10
    stats = engine.stats().kv_blocks_by_kind
    assert stats == (("full", 0, peak[0]), ("sliding", 0, peak[1]))


def test_a_decoding_sliding_group_holds_about_a_window(saved):
    folder, _ = saved
    engine = _engine(folder)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    request = engine.add_request(prompt_ids=PROMPT, params=params)
    engine.step()  # the prompt
    while engine.has_unfinished:
        engine.step()
        for table in request.group_tables:
            held = [b for b in table if b != engine.pool.null_block]
            assert len(held) <= 3, table  # the 6 keys of the next query's window span <= 3
    assert len(request.block_table) == 0  # finished: everything given back


def test_prefix_hits_with_per_kind_tables_change_nothing(saved):
    folder, hf = saved
    want, _ = hf_greedy(hf, PROMPT, 10)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = _engine(folder)
    for _ in range(2):  # the second run hits the cached blocks of both kinds
        engine.add_request(prompt_ids=PROMPT, params=params)
        assert [t for o in engine.run_until_done() for t in o.token_ids] == want
    assert engine.pool.prefix_hits >= 16  # (the window's blocks were still cached)
    # a pool small enough that the second prompt evicts blocks the first one released
    # (room for one 32-token sequence and 3 blocks more)
    groups = engine.kv_cache.groups
    engine = _engine(folder, num_blocks=4 + groups.blocks_for(32, BLOCK, 4096))
    for prompt in (PROMPT, PROMPT[::-1], PROMPT):
        expected = want if prompt == PROMPT else hf_greedy(hf, prompt, 10)[0]
        engine.add_request(prompt_ids=prompt, params=params)
        assert [t for o in engine.run_until_done() for t in o.token_ids] == expected
        engine.pool.check_invariants(engine.scheduler.block_tables())


def test_preemption_and_batching_with_per_kind_tables(saved):
    folder, hf = saved
    engine = _engine(folder)
    groups = engine.kv_cache.groups
    # room for one 32-token sequence (prompt 20 + 12 generated) prefilled in chunks of 8 and
    # a little more: four of them preempt each other
    num_blocks = 2 + groups.blocks_for(32, BLOCK, 16)
    assert_preemption_and_batching_change_nothing(
        folder, hf, PROMPT, num_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=8
    )


def test_stats_and_metrics_report_blocks_per_kind(saved, capsys):
    from pagedkern.serving.cli import main
    from pagedkern.serving.core.messages import EngineGauges
    from pagedkern.serving.core.metrics import ServerMetrics

    folder, _ = saved
    args = ["--model", str(folder), "--max-tokens", "4", "--ignore-eos", "--backend",
            "reference", "--raw", "--stats", "--block-size", "4", "--num-blocks", "64"]  # fmt: skip
    assert main([*args, "a prompt longer than the window of six"]) in (0, None)
    line = [s for s in capsys.readouterr().err.splitlines() if "per layer kind" in s]
    assert len(line) == 1 and "full 0 (peak " in line[0] and "sliding 0 (peak " in line[0]
    assert main([*args, "--no-kv-per-kind-tables", "a prompt"]) in (0, None)
    assert "per layer kind" not in capsys.readouterr().err
    gauges = EngineGauges(1, 0, 9, 64, kv_blocks_by_kind=[["full", 6, 8], ["sliding", 3, 5]])
    text = ServerMetrics().render(gauges, "m")
    assert 'pagedkern_kv_blocks_used_by_kind{kind="sliding"} 3' in text
    assert 'pagedkern_kv_blocks_peak_by_kind{kind="full"} 8' in text
    assert "by_kind" not in ServerMetrics().render(EngineGauges(1, 0, 9, 64), "m")


def test_qwen2_max_window_layers_gets_per_kind_tables(tmp_path):
    from test_model_transformers import _qwen2_sliding

    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(_qwen2_sliding()).float().eval()  # layer 0 full
    hf.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    engine = _engine(tmp_path, max_num_batched_tokens=8)
    assert engine.kv_cache.groups.windows[0] is None and WINDOW in engine.kv_cache.groups.windows
    (got,), (outputs,) = _greedy(engine, [PROMPT], 16)
    want_tokens, want_logits = hf_greedy(hf, PROMPT, 16)
    assert_logprobs_follow(outputs, want_tokens, want_logits)
    assert engine.pool.peak_by_kind[1] < engine.pool.peak_by_kind[0]


def test_the_batch_layout_carries_every_groups_tables_and_slots():
    from pagedkern.model import SequenceChunk, layout_batch

    prefill = SequenceChunk([1, 2, 3, 4, 5], 3, [7, 8], [[10, 9], [16, 11]])  # positions 3..7
    decode = SequenceChunk([6], 5, [4, 5], [[12, 13], [14, 15]])  # position 5
    layout = layout_batch([prefill, decode], BLOCK)
    _, meta = layout.upload("cpu")
    _, packed = layout.unpack(layout.pack())  # the path of a CUDA upload
    for m in (meta, packed):
        assert m.slot_mapping.tolist() == [7 * 4 + 3, 8 * 4, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 21]
        tables = [t.tolist() for t in m.group_block_tables]
        assert tables == [[[10, 9], [12, 13]], [[16, 11], [14, 15]]]
        assert [s.tolist() for s in m.group_slot_mappings] == [
            [43, 36, 37, 38, 39, 53],
            [67, 44, 45, 46, 47, 61],
        ]
        assert m.for_group(0) is m
        g2 = m.for_group(2)
        assert g2.block_tables is m.group_block_tables[1] and g2.seq_lens is m.seq_lens
    with pytest.raises(ValueError, match="group tables"):
        layout_batch([SequenceChunk([1], 0, [3], [[4, 5]])], BLOCK)
