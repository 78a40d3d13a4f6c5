"""Windowed KV release: for a model whose every layer has a sliding window (Mistral-style), the
scheduler frees the blocks no future query can see, their table entries becoming the pool's
null block. Checked on the pool and scheduler directly, then through the engine with a tiny
windowed Mistral that transformers saved: greedy tokens and logprobs equal with and without
the release (and transformers'), through chunked prefill, a prefix-cache hit on released
blocks and preemption, while the pool holds a bounded number of blocks per sequence. Models
with a full-attention layer (Gemma 2/3, Qwen2 past max_window_layers) release nothing: those
layers read every block of the one table all layers share."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import write_tokenizer
from transformers_oracle import assert_preemption_and_batching_change_nothing, hf_greedy

import pagedkern.engine.kv_setup as kv_setup_module
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.block_pool import BlockPool
from pagedkern.engine.request import Request
from pagedkern.engine.scheduler import Scheduler, SchedulerConfig, released_kv_window
from pagedkern.model.config import FULL, SLIDING

transformers = pytest.importorskip("transformers")

PROMPT = [5, 77, 301, 12, 250, 9, 33, 120, 64, 7, 199, 3, 42, 318, 91, 17, 260, 88, 2, 150]
WINDOW, BLOCK = 6, 4


def test_the_null_block_is_never_allocated_freed_or_cached():
    pool = BlockPool(5, 4, reserve_null_block=True)
    assert pool.null_block == 0 and pool.num_free == 4
    assert (pool.num_blocks, pool.num_used) == (4, 0)  # reserved: neither used nor free
    taken = pool.allocate(4)
    assert 0 not in taken and pool.allocate(1) is None
    pool.register(0, b"h" * 16)
    assert pool.lookup_prefix([b"h" * 16], 1) == []
    table = [0, 0, *taken[2:]]  # two released entries
    pool.free(taken[:2])
    pool.check_invariants([table])
    pool.free(table)
    pool.acquire([0])
    assert pool.num_free == 4 and pool.num_used == 0
    pool.check_invariants([])


def _scheduler(window, num_blocks=12):
    pool = BlockPool(num_blocks, BLOCK, reserve_null_block=window is not None)
    return Scheduler(pool, SchedulerConfig(max_model_len=100, kv_window=window))


def test_release_frees_exactly_the_blocks_older_than_every_future_window():
    sched = _scheduler(WINDOW)
    request = Request("r", list(range(30)), SamplingParams(max_tokens=4))
    request.block_table = sched.pool.allocate(8)
    held = list(request.block_table)
    # the next query sits at 13: it sees keys 8..13, i.e. blocks 2.. (tokens 0..7 go)
    sched.release_outside_window(request, 13)
    assert request.block_table[:2] == [0, 0] and request.block_table[2:] == held[2:]
    assert sched.pool.num_free == 11 - 8 + 2
    sched.release_outside_window(request, 13)  # nothing more to release
    assert sched.pool.num_free == 5
    sched.release_outside_window(request, 18)  # keys 13..18: block 3 on
    assert request.block_table[:3] == [0, 0, 0] and sched.pool.num_free == 6
    sched.pool.check_invariants([request.block_table])
    no_window = _scheduler(None)
    other = Request("s", list(range(30)), SamplingParams(max_tokens=4))
    other.block_table = no_window.pool.allocate(8)
    no_window.release_outside_window(other, 29)
    assert no_window.pool.num_free == 4


def test_only_models_windowed_on_every_layer_release():
    from pagedkern.model.config import ModelConfig

    base = dict(
        name="t", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=4,
    )  # fmt: skip
    every = ModelConfig(**base, sliding_window=8, layer_types=(SLIDING,) * 3)
    mixed = ModelConfig(**base, sliding_window=8, layer_types=(SLIDING, FULL, SLIDING))
    assert released_kv_window(every, EngineConfig()) == 8
    assert released_kv_window(mixed, EngineConfig()) is None  # the full layer reads them all
    assert released_kv_window(ModelConfig(**base), EngineConfig()) is None
    assert (
        released_kv_window(every, EngineConfig(speculative="draft", draft_model="self:1")) is None
    )


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        sliding_window=WINDOW,
    )  # fmt: skip
    hf = transformers.MistralForCausalLM(config).float().eval()
    folder = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder, hf


def _run(folder, prompts, steps, release=True, monkeypatch=None, **engine_args):
    """(outputs per prompt: tokens and logprobs, the most blocks in use after any step, the
    engine), running `prompts` together."""
    if not release:
        monkeypatch.setattr(kv_setup_module, "released_kv_window", lambda *a: None)
    engine = Engine.from_config(
        EngineConfig(
            model=str(folder), backend="reference", dtype="float32", block_size=BLOCK,
            **{"num_blocks": 64, **engine_args},
        )
    )  # fmt: skip
    if not release:
        monkeypatch.undo()
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=1)
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    got: dict[str, list] = {r.request_id: [] for r in requests}
    most = 0
    while engine.has_unfinished:
        for output in engine.step():
            got[output.request_id] += [(t, output.logprobs) for t in output.token_ids]
        most = max(most, engine.pool.num_blocks - engine.pool.num_free)
        engine.pool.check_invariants(engine.scheduler.block_tables())
    return [got[r.request_id] for r in requests], most, engine


def test_release_changes_no_output_and_bounds_the_blocks_held(mistral, monkeypatch):
    folder, hf = mistral
    steps = 24
    want, _ = hf_greedy(hf, PROMPT, steps)
    # chunked prefill (8-token chunks release blocks mid-prompt too), two sequences at once
    prompts = [PROMPT, PROMPT[5:] + PROMPT[:5]]
    args = dict(max_num_batched_tokens=8)
    released, most_released, engine = _run(folder, prompts, steps, **args)
    kept, most_kept, _ = _run(folder, prompts, steps, False, monkeypatch, **args)
    assert engine.scheduler.config.kv_window == WINDOW
    assert released == kept
    # asynchronous scheduling: released at the end of the step that computed the tokens
    overlapped, most_overlapped, _ = _run(folder, prompts, steps, async_scheduling=True, **args)
    assert overlapped == kept and most_overlapped <= 2 * 5
    assert [t for t, _ in released[0]] == want
    # up to 43 cached tokens = 11 blocks per sequence held without the release (one sequence
    # may finish, and free, in the step the other fills its last); with it a window of 6 and
    # the block being filled span at most 3 (plus, briefly, a chunk's new blocks)
    assert most_kept >= 2 * 10
    assert most_released <= 2 * 5


def test_a_prefix_hit_after_release_reads_only_valid_blocks(mistral):
    folder, hf = mistral
    want, _ = hf_greedy(hf, PROMPT, 10)
    engine = Engine.from_config(
        EngineConfig(model=str(folder), backend="reference", num_blocks=64, block_size=BLOCK)
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second run hits the released (still cached, unevicted) blocks
        engine.add_request(prompt_ids=PROMPT, params=params)
        assert [t for o in engine.run_until_done() for t in o.token_ids] == want
    assert engine.pool.prefix_hits > 0
    # a small pool: released blocks are reallocated (their hashes dropped) between the runs
    engine = Engine.from_config(
        EngineConfig(model=str(folder), backend="reference", num_blocks=9, block_size=BLOCK)
    )
    for prompt in (PROMPT, PROMPT[::-1], PROMPT):
        expected = want if prompt == PROMPT else hf_greedy(hf, prompt, 10)[0]
        engine.add_request(prompt_ids=prompt, params=params)
        assert [t for o in engine.run_until_done() for t in o.token_ids] == expected


def test_preemption_and_batching_with_release(mistral):
    # (the oracle's default pool of 18 blocks no longer preempts: the release makes room; here
    # 7 usable blocks for four 12-token prompts, each longer than the window)
    folder, hf = mistral
    assert_preemption_and_batching_change_nothing(
        folder, hf, PROMPT[:12], num_blocks=8, block_size=BLOCK
    )
