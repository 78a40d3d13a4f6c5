"""The Python API without footguns: LLM takes one prompt or many, text or ids, one
conversation or many; stream() keeps other requests' outputs; outputs are immutable snapshots;
stats() reports the engine's state; the op backend is the engine's, not the process's; the
engine's defaults live in EngineConfig alone."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from pagedkern import ops
from pagedkern.engine import (
    LLM,
    Engine,
    EngineConfig,
    EngineStats,
    FinishReason,
    SamplingParams,
    SchedulerConfig,
    engine_fields,
)
from pagedkern.model.config import FULL, PRESETS, SLIDING

TINY = "synthetic:tiny"
PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY, backend="reference", num_blocks=256, block_size=4)


def answer(g) -> tuple:
    return g.text, g.token_ids, g.prompt_token_ids, g.finish_reason


def make_engine(**overrides) -> Engine:
    config = dict(model=TINY, backend="reference", num_blocks=128, block_size=4)
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


def test_generate_takes_one_prompt_as_one_request(llm):
    one = llm.generate("hello there", PARAMS)
    assert len(one) == 1 and len(one[0].token_ids) == 5
    assert [answer(g) for g in llm.generate(["hello there"], PARAMS)] == [answer(one[0])]


def test_generate_takes_token_id_prompts(llm):
    ids = list(llm.engine.tokenizer.encode("hello there"))
    (text,) = llm.generate("hello there", PARAMS)
    (one,) = llm.generate(ids, PARAMS)  # one prompt as ids
    assert one.token_ids == text.token_ids and one.prompt_token_ids == tuple(ids)
    many = llm.generate(
        [ids, ids[:2], {"prompt_token_ids": ids}, {"prompt": "hello there"}], PARAMS
    )
    assert [g.token_ids for g in many] == [one.token_ids, many[1].token_ids] + [one.token_ids] * 2
    assert many[1].prompt_token_ids == tuple(ids[:2])


def test_chat_takes_one_conversation_or_many(llm):
    hi = [{"role": "user", "content": "hi"}]
    bye = [{"role": "user", "content": "bye, and thanks for all the fish"}]
    (one,) = llm.chat(hi, PARAMS)
    assert answer(llm.chat([hi, bye], PARAMS)[0]) == answer(one)
    assert llm.chat([bye], PARAMS)[0].prompt_token_ids != one.prompt_token_ids


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="prompt_ids"):
        llm.generate(["fine", [5, 10**6]], PARAMS)
    assert not llm.engine.has_unfinished and llm.engine.pool.num_used == 0


def test_stream_keeps_the_outputs_of_requests_sharing_its_steps():
    engine = make_engine()
    other = engine.add_request(prompt_ids=list(range(3, 20)), params=PARAMS)
    streamed = list(engine.stream(prompt_ids=list(range(30, 40)), params=PARAMS))
    assert len(streamed) == 5 and streamed[-1].finished
    rest = list(engine.run_until_done())  # what the stream set aside for `other`, then more
    tokens = [t for o in rest if o.request_id == other.request_id for t in o.token_ids]
    assert tokens == list(other.output_ids) and len(tokens) == 5
    assert {o.request_id for o in rest} == {other.request_id}


def test_outputs_are_immutable_snapshots():
    engine = make_engine()
    request = engine.add_request(prompt_ids=[5, 6, 7], params=PARAMS)
    first = engine.step()[0]
    outputs = [first, *engine.run_until_done()]
    assert not hasattr(first, "request")  # no live Request inside
    assert first.output_token_ids == first.token_ids and len(first.token_ids) == 1
    assert first.metrics.num_output_tokens == 1 and not first.finished
    assert first.prompt_token_ids == (5, 6, 7) and isinstance(first.token_ids, tuple)
    last = outputs[-1]
    assert last.finished and last.output_token_ids == tuple(request.output_ids)
    assert last.metrics.num_output_tokens == 5 and len(last.metrics.itl) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.text = "changed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.metrics.num_output_tokens = 3


def test_stats_report_the_engine_state():
    engine = make_engine(max_num_seqs=2)
    fresh = engine.stats()
    assert isinstance(fresh, EngineStats)
    assert (fresh.num_running, fresh.num_waiting, fresh.num_blocks_used) == (0, 0, 0)
    assert fresh.num_blocks_total == fresh.num_blocks_free == 128 and fresh.block_size == 4
    prompt = list(range(3, 23))  # 5 full blocks
    for _ in range(3):
        engine.add_request(prompt_ids=prompt, params=PARAMS)
    assert engine.stats().num_waiting == 3
    engine.step()
    mid = engine.stats()
    assert (mid.num_running, mid.num_waiting) == (2, 1)
    assert mid.num_blocks_used == engine.pool.num_used > 0
    assert mid.num_blocks_used + mid.num_blocks_free == 128
    list(engine.run_until_done())
    end = engine.stats()
    assert end.num_finished == 3 and end.num_generated_tokens == 15
    assert end.num_prompt_tokens == 60 and end.num_blocks_used == 0
    assert end.prefix_cache_hits == 4 * 4  # the third request found 4 of the 5 blocks cached
    assert end.prefix_cache_hit_rate == end.prefix_cache_hits / end.prefix_cache_queries


def windowed_engine(layer_types: tuple[str, ...], **overrides) -> Engine:
    """An engine over synthetic weights of the tiny preset's shape with these layer kinds and
    a window of 6 (all sliding: windowed release; sliding + full: per-kind tables): both keep
    the pool's null block."""
    model = PRESETS["tiny"].replace(
        name="tiny-windowed", num_layers=len(layer_types), sliding_window=6,
        layer_types=layer_types,
    )  # fmt: skip
    config = EngineConfig(
        **dict(model=TINY, backend="reference", num_blocks=64, block_size=4) | overrides
    )
    engine = Engine(*dataclasses.replace(config.model_spec(), model=model).load("cpu"), config)
    engine.owns_model = True
    return engine


@pytest.mark.parametrize(
    "layer_types", [(SLIDING, SLIDING), (SLIDING, FULL)], ids=["all sliding", "hybrid"]
)
def test_the_null_block_counts_neither_used_nor_free(layer_types):
    from pagedkern.serving.core.engine_core import gauges

    engine = windowed_engine(layer_types, enable_prefix_caching=False)
    pool = engine.pool
    assert pool.null_block is not None
    assert (engine.scheduler.hybrid is not None) == (FULL in layer_types)
    fresh = engine.stats()
    assert (fresh.num_blocks_used, fresh.num_blocks_free, fresh.num_blocks_total) == (0, 63, 63)
    idle = gauges(engine)
    assert (idle.kv_blocks_used, idle.kv_blocks_total) == (0, 63)
    # a sequence never outgrows what requests can hold
    assert engine.max_model_len <= fresh.num_blocks_total * fresh.block_size
    prompt = list(range(3, 23))
    request = engine.add_request(prompt_ids=prompt, params=PARAMS)
    engine.step()
    held = {b for t in engine.scheduler.block_tables() for b in t if b != pool.null_block}
    mid = engine.stats()
    assert held and mid.num_blocks_used == len(held) == sum(pool.used_by_kind)
    assert mid.num_blocks_used + mid.num_blocks_free == mid.num_blocks_total == 63
    list(engine.run_until_done())
    assert request.is_finished and not engine.has_unfinished
    end = engine.stats()
    assert (end.num_blocks_used, end.num_blocks_free, end.num_blocks_total) == (0, 63, 63)
    pool.check_invariants([])


def test_from_config_leaves_the_process_backend_alone():
    before = ops.get_backend()
    engine = make_engine(backend="reference")
    assert ops.get_backend() == before == "auto" and engine.backend == "reference"
    seen = []
    with ops.use_backend("reference"):
        threading.Thread(target=lambda: seen.append(ops.get_backend())).start()
        assert ops.get_backend() == "reference"
    assert seen == ["auto"] or not seen  # another thread keeps the process default
    assert ops.get_backend() == "auto"
    request = engine.add_request(prompt_ids=[5, 6, 7], params=PARAMS)
    list(engine.run_until_done())
    assert request.finish_reason is FinishReason.LENGTH


def test_engine_defaults_live_in_engine_config_alone():
    fields = engine_fields()
    defaults = EngineConfig()
    assert set(fields) == {f.name for f in dataclasses.fields(EngineConfig)}
    for name, f in fields.items():
        assert f.default == getattr(defaults, name) and len(f.help) > 10, name
        assert f.flag == "--" + name.replace("_", "-")
    scheduler = SchedulerConfig(max_model_len=100)
    assert scheduler.max_num_seqs == defaults.max_num_seqs
    assert scheduler.max_num_batched_tokens == defaults.max_num_batched_tokens
    assert scheduler.enable_chunked_prefill == defaults.enable_chunked_prefill
    built = SchedulerConfig.from_engine(EngineConfig(max_num_seqs=3, max_num_batched_tokens=9), 50)
    assert (built.max_num_seqs, built.max_num_batched_tokens, built.max_model_len) == (3, 9, 50)


def test_the_serving_queue_limit_defaults_to_the_engine_configs():
    from pagedkern.serving.core.engine_client import EngineClient

    engine = make_engine(max_queue=7)
    assert EngineClient.in_thread(engine).max_queue == 7
    assert EngineClient.in_thread(engine, max_queue=3).max_queue == 3
