"""The CPU backend's one-call decoder (ops/cpu/decoder.py, csrc/cpu/decoder.cpp) against the
layer loop it replaces (cpu_decoder:layers): the same hidden states and the same KV-cache
writes bit for bit, for int4 and int8 weights, with and without q/k/v and O biases, fp32 and fp8
caches, for the dense families' layers (QK-norm, sliding windows, GeGLU, sandwich norms,
soft-cap, sinks, a local RoPE base), mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE's shared
expert, sigmoid scoring after a dense layer) and a hybrid cache's per-group tables, over
prefill chunks, decode rows and both in one step, over several steps; one decoder call a step;
the models, caches and variants it refuses run the loop; and int4 engines' steps take it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import PRESETS, SequenceChunk, build_batch, load_model
from pagedkern.model.config import FULL, SLIDING
from pagedkern.model.kv_cache import kv_layer_groups
from pagedkern.ops.cpu import quant_gemv

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")
BLOCK = 16


def _steps(model):
    """Three steps over two sequences: prefills, a decode beside a prefill chunk, decodes."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    a, b = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 70))
    return [
        [SequenceChunk(a, 0, [1, 2, 3])],
        [SequenceChunk([5], 40, [1, 2, 3]), SequenceChunk(b[:50], 0, [4, 5, 6, 7, 8])],
        [SequenceChunk([6], 41, [1, 2, 3]), SequenceChunk(b[50:], 50, [4, 5, 6, 7, 8])],
        [SequenceChunk([7], 42, [1, 2, 3]), SequenceChunk([8], 70, [4, 5, 6, 7, 8])],
    ]


def _with_groups(ids, meta, groups):
    """The batch with a hybrid cache's tables: group g's blocks are group 0's plus GROUP_STEP * g
    (disjoint ids in one pool, as the engine's per-kind tables)."""
    if groups is None:
        return ids, meta
    steps = range(1, groups.num_groups)
    tables = tuple(meta.block_tables + GROUP_STEP * g for g in steps)
    slots = meta.slot_mapping.long()
    mappings = tuple(torch.where(slots >= 0, slots + GROUP_STEP * g * BLOCK, -1) for g in steps)
    return ids, dataclasses.replace(meta, group_block_tables=tables, group_slot_mappings=mappings)


GROUP_STEP = 10  # block ids a group's table is shifted by


def _run_steps(model, variant: str, kernels, grouped=False):
    """(the hidden states of each step, the whole KV cache after them)."""
    kernels(cpu_decoder=variant)
    groups = kv_layer_groups(model.config) if grouped else None
    blocks = 12 if groups is None else 12 + GROUP_STEP * (groups.num_groups - 1)
    kv = model.allocate_kv_cache(blocks, BLOCK, groups)
    kv.data.fill_(float("nan"))  # never-written slots stay NaN
    with ops.use_backend("cpu"):
        hidden = [
            model.hidden_states(*_with_groups(*build_batch(step, BLOCK), groups), kv)
            for step in _steps(model)
        ]
    return hidden, kv.data


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "bfloat16", "float16"])
def test_the_decoder_gives_the_layer_loops_bits(
    quantization, biases, kv_dtype, kernels, decoder_runs
):
    config = PRESETS["tiny"].replace(qkv_bias=biases, o_bias=biases)
    model, _ = load_model(config, quantization=quantization, kv_cache_dtype=kv_dtype, seed=3)
    if kv_dtype == "fp8":  # calibrated per-layer scales, unlike each other and 1
        assert len(set(model.kv_scales())) == config.num_layers and model.kv_scales()[0][0] != 1
    got, got_kv = _run_steps(model, "fused", kernels)
    assert decoder_runs == [40, 51, 21, 2]  # one call a step, every row
    want, want_kv = _run_steps(model, "layers", kernels)
    assert len(decoder_runs) == 4  # the loop made none
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any()
        assert torch.equal(g, w), f"step {step}"
    assert_same_cache(got_kv, want_kv)


def assert_same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bytes (fp8 caches compared as bytes; NaN poison where nothing was written)."""
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


WINDOW = 8  # (sequence b's 70 tokens reach well past it)
FAMILIES = {
    "qwen3": dict(qk_norm=True),
    "mistral": dict(sliding_window=WINDOW, layer_types=(SLIDING, SLIDING)),
    "gemma2": dict(
        hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=8.0, attn_scale=0.2,
        attn_soft_cap=5.0, final_soft_cap=30.0, sliding_window=WINDOW,
        layer_types=(SLIDING, FULL),
    ),
    "gemma3": dict(
        qk_norm=True, hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=8.0,
        sliding_window=WINDOW, num_layers=3, layer_types=(SLIDING, SLIDING, FULL),
        rope_local_theta=100.0,
    ),
    "sinks": {},  # (gpt-oss's attention: its learned sink logits, set below)
    # mixture-of-experts layers (their MLP: csrc/cpu/moe_mlp.h)
    "qwen3_moe": dict(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(
        qkv_bias=True, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=False, shared_expert_size=64,
    ),
    "dense_and_moe": dict(  # a dense first layer, then sigmoid-scored experts with GeGLU
        hidden_act="gelu_tanh", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        moe_scoring="sigmoid", dense_layers=(0,),
    ),
}  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "bfloat16", "float16"])
@pytest.mark.parametrize("grouped", [False, True], ids=["one table", "per-kind tables"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_families_layers_give_the_loops_bits(family, grouped, kv_dtype, kernels, decoder_runs):
    config = PRESETS["tiny"].replace(**FAMILIES[family])
    if grouped and kv_layer_groups(config) is None:
        pytest.skip("one kind of layer: no per-kind tables")
    model, _ = load_model(config, quantization="int4", kv_cache_dtype=kv_dtype, seed=5)
    if family == "sinks":
        for n, layer in enumerate(model.weights.layers):
            layer.sinks = torch.linspace(-1.0, 2.0, config.num_heads) * (n + 1)
    got, got_kv = _run_steps(model, "fused", kernels, grouped)
    assert decoder_runs == [40, 51, 21, 2]  # one call a step, every row
    want, want_kv = _run_steps(model, "layers", kernels, grouped)
    assert len(decoder_runs) == 4  # the loop made none
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any()
        assert torch.equal(g, w), f"step {step}"
    assert_same_cache(got_kv, want_kv)
    if config.num_experts:  # (and the loop ran the MoE layers' MLP in the tail's call)
        tail = model._cpu.tail.for_step()
        moe = [tail.weights_of(layer).moe is not None for layer in model.weights.layers]
        assert moe == [config.is_moe_layer(n) for n in range(config.num_layers)]


def test_the_families_options_change_the_result(kernels):
    """Each option the decoder takes reaches its computation: a model with it differs from the
    same weights without it (so the equality above is not two paths ignoring it alike)."""
    base, _ = load_model(PRESETS["tiny"].replace(**FAMILIES["gemma3"]), quantization="int4")
    plain = base.config.replace(sliding_window=None, layer_types=(), rope_local_theta=None)
    hidden = _run_steps(base, "fused", kernels)[0][-1]
    for change in (dict(qk_norm=False), dict(hidden_act="silu"), dict(sandwich_norms=False)):
        other, _ = load_model(base.config.replace(**change), quantization="int4")
        assert not torch.equal(_run_steps(other, "fused", kernels)[0][-1], hidden), change
    windowless, _ = load_model(plain, quantization="int4")
    assert not torch.equal(_run_steps(windowless, "fused", kernels)[0][-1], hidden)


@pytest.mark.parametrize(
    "case", ["fp32 weights", "whole-projection QK-norm", "bf16 activations", "tiles attention",
             "layers variant", "experts on the host loop", "gpt-oss experts"],
)  # fmt: skip
def test_what_it_refuses_runs_the_layer_loop(case, kernels, decoder_runs):
    config, quantization, dtype = PRESETS["tiny"], "int4", None
    if case in ("experts on the host loop", "gpt-oss experts"):
        config = config.replace(**FAMILIES["qwen3_moe"])
    if case == "experts on the host loop":
        kernels(cpu_moe="loop")
    elif case == "gpt-oss experts":  # (its clamped SwiGLU runs the ops)
        config = config.replace(swiglu_limit=7.0)
    elif case == "fp32 weights":
        quantization = None
    elif case == "whole-projection QK-norm":  # (OLMoE's)
        config = config.replace(qk_norm=True, qk_norm_whole=True)
    elif case == "bf16 activations":
        dtype = torch.bfloat16
    elif case == "tiles attention":
        kernels(cpu_attention="tiles")
    elif case == "layers variant":
        kernels(cpu_decoder="layers")
    model, _ = load_model(config, quantization=quantization, dtype=dtype)
    kv = model.allocate_kv_cache(12, BLOCK)
    with ops.use_backend("cpu"):
        h = model.hidden_states(*build_batch(_steps(model)[0], BLOCK), kv)
    assert decoder_runs == [] and not h.isnan().any()


def test_a_variant_switched_between_steps_reaches_the_next_step(kernels, decoder_runs):
    """The decoder built for a MoE model is not reused once `cpu_moe:loop` rules its MLP out."""
    model, _ = load_model(PRESETS["tiny"].replace(**FAMILIES["qwen3_moe"]), quantization="int4")
    kv = model.allocate_kv_cache(12, BLOCK)
    steps = _steps(model)
    with ops.use_backend("cpu"):
        model.hidden_states(*build_batch(steps[0], BLOCK), kv)
        assert decoder_runs == [40]
        kernels(cpu_moe="loop")
        h = model.hidden_states(*build_batch(steps[1][:1], BLOCK), kv)
    assert decoder_runs == [40] and not h.isnan().any()


def test_an_int4_engine_steps_through_it(decoder_runs):
    config = EngineConfig(
        model="synthetic:tiny", backend="cpu", quantization="int4", num_blocks=64, block_size=4
    )
    engine = Engine.from_config(config)
    engine.add_request(
        prompt_ids=list(range(3, 30)), params=SamplingParams(max_tokens=5, ignore_eos=True)
    )
    list(engine.run_until_done())
    assert decoder_runs[0] == 27 and decoder_runs[1:] == [1, 1, 1, 1]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_the_decoder_on_a_team_of_two_gives_one_threads_bits(family, kv_dtype, kernels):
    """The step's layers on one team (csrc/cpu/parallel.h: the ops' bodies handed to its second
    thread) give the one-thread layer loop's bits."""
    config = PRESETS["tiny"].replace(**FAMILIES.get(family, {}))
    model, _ = load_model(config, quantization="int4", kv_cache_dtype=kv_dtype, seed=7)
    threads = torch.get_num_threads()
    module = quant_gemv.cpu_module()
    try:
        torch.set_num_threads(1)
        want, want_kv = _run_steps(model, "layers", kernels)
        before = module.team_jobs()
        torch.set_num_threads(2)
        got, got_kv = _run_steps(model, "fused", kernels)
    finally:
        torch.set_num_threads(threads)
    if module.OPENMP:
        assert module.team_jobs() > before  # (the team ran the ops' bodies)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any()
        assert torch.equal(g, w), f"step {step}"
    assert_same_cache(got_kv, want_kv)


def _padded(ids, meta, pad: int):
    """The step with `pad` rows past its last chunk (a padded batch's rows: no key, no write)."""
    ids = torch.cat([ids, ids.new_zeros(pad)])
    positions = torch.cat([meta.positions, meta.positions.new_zeros(pad)])
    slots = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
    return ids, dataclasses.replace(meta, positions=positions, slot_mapping=slots)


def test_rows_past_the_last_chunk_see_no_key_as_in_the_loop(kernels, decoder_runs):
    model, _ = load_model(PRESETS["tiny"], quantization="int4", seed=5)
    hidden, caches = [], []
    for variant in ("fused", "layers"):
        kernels(cpu_decoder=variant)
        kv = model.allocate_kv_cache(12, BLOCK)
        kv.data.fill_(float("nan"))
        with ops.use_backend("cpu"):
            for step in _steps(model)[:2]:
                h = model.hidden_states(*_padded(*build_batch(step, BLOCK), 3), kv)
        hidden.append(h)
        caches.append(kv.data)
    assert decoder_runs == [43, 54]  # (the fused steps, padding rows included)
    assert not hidden[0].isnan().any()
    assert torch.equal(hidden[0], hidden[1])
    assert_same_cache(*caches)


@pytest.mark.parametrize("bounds", ["past the rows", "falling", "not from 0"])
def test_query_bounds_that_do_not_fit_the_rows_are_refused(bounds, kernels, decoder_runs):
    model, _ = load_model(PRESETS["tiny"], quantization="int4")
    kv = model.allocate_kv_cache(12, BLOCK)
    ids, meta = build_batch(_steps(model)[1], BLOCK)  # a decode row, then a 50-row chunk
    cu = meta.cu_seqlens.clone()
    if bounds == "past the rows":
        cu[-1] += 1
    elif bounds == "falling":
        cu[1] = cu[2] + 1
    else:
        cu[0] = 1
    with ops.use_backend("cpu"), pytest.raises(ValueError, match="cu_seqlens"):
        model.hidden_states(ids, dataclasses.replace(meta, cu_seqlens=cu), kv)
    assert decoder_runs == [51]


@pytest.mark.parametrize("short", ["positions", "slot_mapping", "seq_lens"])
def test_metadata_shorter_than_the_rows_is_refused(short, kernels, decoder_runs):
    model, _ = load_model(PRESETS["tiny"], quantization="int4")
    kv = model.allocate_kv_cache(12, BLOCK)
    ids, meta = build_batch(_steps(model)[1], BLOCK)
    meta = dataclasses.replace(meta, **{short: getattr(meta, short)[:-1]})
    with ops.use_backend("cpu"), pytest.raises(ValueError, match="rows"):
        model.hidden_states(ids, meta, kv)
    assert decoder_runs == [51]  # (refused by the decoder's call, before its C++)
