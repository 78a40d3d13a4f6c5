"""Gemma 2 and Gemma 3 (text) against HF transformers: tiny random models built and saved by
transformers, loaded by pagedkern from the folder (and from a GGUF written as llama.cpp's
converter writes them), must give transformers' logits in fp32 (prefill and every decode step)
and its greedy continuation token for token through the engine, with chunked prefill and
prefix-cache hits. The models are shaped so every Gemma option matters: a sliding window of 6
against a 20-token prompt, soft-caps that bite (Gemma 2), a local RoPE base and linearly
scaled global RoPE (Gemma 3), head_dim 32 with hidden 64 over 4 heads, a query_pre_attn_scalar
that is not head_dim, norm weights far from 0 (they scale by 1 + w)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from hf_model_files import all_logits, finish_gguf, gguf_writer_like_llama_cpp, write_tokenizer
from transformers_oracle import (
    assert_a_prefix_cache_hit_changes_nothing,
    assert_logprobs_follow,
    assert_preemption_and_batching_change_nothing,
    decode_logits,
    engine_greedy,
    hf_greedy,
    hf_logits,
    relative,
)

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")
Q8 = gguf.GGMLQuantizationType.Q8_0

PROMPT = [5, 77, 301, 12, 250, 9, 33, 120, 64, 7, 199, 3, 42, 318, 91, 17, 260, 88, 2, 150]
STEPS = 32
WINDOW = 6
COMMON = dict(
    vocab_size=400,  # the tokenizer write_tokenizer trains
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,
)


def _gemma2(**changes):
    options = dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    return transformers.Gemma2Config(**{**COMMON, **options, **changes})


def _gemma3(**changes):
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    }
    options = dict(rope_parameters=rope, sliding_window_pattern=3)  # layers 0, 1, 3 local
    return transformers.Gemma3TextConfig(**{**COMMON, **options, **changes})


ARCHITECTURES = {
    "gemma2": (_gemma2, transformers.Gemma2ForCausalLM),
    "gemma3": (_gemma3, transformers.Gemma3ForCausalLM),
}


def _hf_model(arch: str, **changes):
    make_config, model_class = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = model_class(make_config(**changes)).float().eval()
    with torch.no_grad():  # transformers starts Gemma's norms at w = 0 (a scale of 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def saved(request, tmp_path_factory):
    """(folder, the transformers model in fp32 eval mode) of one architecture."""
    model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder, model


def test_prefill_logits_equal_transformers(saved):
    folder, hf = saved
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    want = hf_logits(hf, PROMPT)
    got = all_logits(model, PROMPT).double()
    assert relative(got, want) < 1e-5, (relative(got, want), (got - want).abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_gemma_options_change_transformers_logits(arch):
    # The test models are shaped so each option matters: without it transformers' own logits
    # move far more than the tolerance above.
    want = hf_logits(_hf_model(arch), PROMPT)
    changes = [dict(sliding_window=1000), dict(query_pre_attn_scalar=32)]
    if arch == "gemma2":
        changes += [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None)]
    else:
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        }
        changes += [dict(rope_parameters=rope)]
    for change in changes:
        assert relative(hf_logits(_hf_model(arch, **change), PROMPT), want) > 1e-2, change


def test_decode_steps_logits_equal_transformers(saved):
    folder, hf = saved
    tokens, want = hf_greedy(hf, PROMPT, STEPS)
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    with ops.use_backend("cpu"):  # its decode plan (global layers; sliding: the one-shot op)
        got = decode_logits(model, PROMPT, tokens[:-1]).double()
    errors = [relative(g, w) for g, w in zip(got, want.double(), strict=True)]
    assert max(errors) < 1e-5, errors
    assert got.argmax(-1).tolist() == tokens


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 8}],  # the prompt prefilled whole, or in chunks of 8
    ids=["whole prefill", "chunked prefill"],
)
def test_greedy_decode_equals_transformers_token_for_token(saved, engine_args):
    folder, hf = saved
    want_tokens, want_logits = hf_greedy(hf, PROMPT, STEPS)
    outputs = engine_greedy(folder, PROMPT, STEPS, **engine_args)
    assert_logprobs_follow(outputs, want_tokens, want_logits)


def test_a_prefix_cache_hit_changes_nothing(saved):
    folder, hf = saved
    assert_a_prefix_cache_hit_changes_nothing(folder, hf, PROMPT)


def test_preemption_and_batching_change_nothing(saved):
    # Four sequences in a pool that holds two: preempted, recomputed (their prompts and
    # generated tokens prefilled again, past the window), batched with each other; one block
    # table for every layer (per-kind tables: test_hybrid_kv_tables.py)
    folder, hf = saved
    assert_preemption_and_batching_change_nothing(folder, hf, PROMPT, kv_per_kind_tables=False)


def test_the_static_buffer_and_piecewise_paths_change_nothing(saved, monkeypatch):
    # cuda_graphs=True on the CPU runs the CUDA-graph paths' padded static buffers eagerly:
    # mixed steps in pieces (embed_and_norm, layer_tail, _attention by layer, compute_logits),
    # which must apply every Gemma option as the plain forward does.
    from pagedkern.engine.piecewise_graphs import PiecewiseGraphs

    folder, hf = saved
    runs = []
    run = PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, lay: runs.append(1) or run(self, lay))
    prompts = [PROMPT[i:] + PROMPT[:i] for i in (0, 5, 9)]
    want = [hf_greedy(hf, p, 10)[0] for p in prompts]
    engine = Engine.from_config(
        EngineConfig(
            model=str(folder), backend="reference", num_blocks=64, block_size=4,
            max_num_batched_tokens=8, cuda_graphs=True,
        )
    )  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    assert [r.output_ids for r in requests] == want
    assert runs  # mixed steps went piecewise


def _write(folder, arch: str, **changes) -> None:
    _hf_model(arch).save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "arch, changes, words",
    [
        ("gemma2", dict(sliding_window=0), "sliding_window"),
        ("gemma2", dict(sliding_window=2.5), "sliding_window"),
        ("gemma2", dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
        ("gemma2", dict(final_logit_softcapping=0), "final_logit_softcapping"),
        ("gemma2", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
        ("gemma2", dict(hidden_activation="relu"), "hidden_activation"),
        ("gemma2", dict(layer_types=["sliding_attention"]), "layer_types"),
        ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma3", dict(model_type="gemma3"), "gemma3_text"),
    ],
)
def test_bad_gemma_configs_name_the_key(tmp_path, arch, changes, words):
    _write(tmp_path, arch, **changes)
    with pytest.raises(ModelLoadError, match=words):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_older_config_spellings_load_the_same_model(tmp_path):
    # Configs written before transformers v5: rope_theta / rope_local_base_freq / rope_scaling
    # and sliding_window_pattern instead of rope_parameters and layer_types.
    hf = _hf_model("gemma3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types"):
        del raw[key]
    raw.update(
        rope_theta=10000.0, rope_local_base_freq=100.0, sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip
    path.write_text(json.dumps(raw))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    assert model.config.layer_types == ("sliding", "sliding", "full", "sliding")
    got = all_logits(model, PROMPT).double()
    assert relative(got, hf_logits(hf, PROMPT)) < 1e-5


def write_gguf_like_llama_cpp(path, hf, arch: str, q8: bool = False) -> None:
    """The transformers model as llama.cpp's convert_hf_to_gguf.py writes a Gemma, in F32: the
    names of gguf's own tensor map, every norm weight stored as 1 + w, no output.weight (tied),
    no Q/K permutation, the metadata its Gemma2Model / Gemma3Model write (no attention scale:
    llama.cpp derives it from the head dim); q8: the matrices in Q8_0, as llama.cpp quantizes."""
    cfg = hf.config
    w = gguf_writer_like_llama_cpp(path, cfg, arch, cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    else:
        full, local = (
            cfg.rope_parameters["full_attention"],
            cfg.rope_parameters["sliding_attention"],
        )
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # the converter skips it: Gemma ties its embeddings
            continue
        arr = t.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + 1
        gname = names.get_name(name, try_suffixes=(".weight",))
        if q8 and arr.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(arr, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    finish_gguf(w)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_gguf_llama_cpp_writes_equals_transformers(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))
    # What a GGUF can say: the attention scale of the head dim, Gemma 3's 5:1 layer pattern
    # (llama.cpp assumes both, its converter writes neither)
    changes = dict(query_pre_attn_scalar=COMMON["head_dim"])
    if arch == "gemma3":
        changes.update(num_hidden_layers=6, sliding_window_pattern=6)
    hf = _hf_model(arch, **changes)
    path = tmp_path / "m.gguf"
    write_gguf_like_llama_cpp(path, hf, arch)
    for _ in range(2):  # converted, then from the weights cache
        model, _ = load_model(
            str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="none"
        )
        want = hf_logits(hf, PROMPT)
        assert relative(all_logits(model, PROMPT), want) < 1e-5
    assert model.config.layer_types == tuple(
        {"sliding_attention": "sliding", "full_attention": "full"}[t] for t in hf.config.layer_types
    )
    assert model.config.tie_word_embeddings and model.config.qk_norm == (arch == "gemma3")


@pytest.mark.parametrize(
    "preset, hf_config",
    [
        ("gemma2-2b", dict(model_type="gemma2")),  # transformers' Gemma2Config defaults: 2B
        ("gemma3-1b", dict(
            model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
            intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
            sliding_window=512, max_position_embeddings=32768,
        )),
    ],
)  # fmt: skip
def test_the_gemma_presets_have_the_published_shapes(preset, hf_config):
    from pagedkern.model import PRESETS
    from pagedkern.model.hf_config import config_from_hf

    kind = hf_config.pop("model_type")
    make = transformers.Gemma2Config if kind == "gemma2" else transformers.Gemma3TextConfig
    config = make(**hf_config)
    with torch.device("meta"):
        model = ARCHITECTURES["gemma2" if kind == "gemma2" else "gemma3"][1](config)
    count = sum(p.numel() for p in model.parameters())  # the tied head once
    assert PRESETS[preset].num_parameters() == count
    ours = config_from_hf(config.to_dict(), "config.json")
    for field in ("layer_types", "sliding_window", "attn_scale", "attn_soft_cap", "final_soft_cap",
                  "rope_theta", "rope_local_theta", "head_dim", "qk_norm"):  # fmt: skip
        assert getattr(ours, field) == getattr(PRESETS[preset], field), field


def test_a_q8_0_gemma_gguf_loads_exactly_and_straight_to_int8(tmp_path, monkeypatch):
    # Q8_0 matrices (the tied embedding too): dequantized they are exactly the weights of a
    # transformers model holding the dequantized values; in int8 mode they become int8 weights
    # without an fp32 detour, close to those logits.
    import gguf.quants

    from pagedkern.model.quantized_linear import QuantizedWeight

    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))
    hf = _hf_model("gemma2", query_pre_attn_scalar=COMMON["head_dim"])
    with torch.no_grad():  # the values the file will hold
        for p in hf.parameters():
            if p.ndim == 2:
                q = gguf.quants.quantize(p.numpy(), Q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, Q8).reshape(p.shape)))
    path = tmp_path / "m.gguf"
    write_gguf_like_llama_cpp(path, hf, "gemma2", q8=True)
    want = hf_logits(hf, PROMPT)
    exact, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="none"
    )
    assert relative(all_logits(exact, PROMPT), want) < 1e-5
    int8, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="int8"
    )
    layer = int8.weights.layers[0]
    assert all(
        isinstance(w, QuantizedWeight) and w.format == "int8" for w in (layer.qkv, layer.down)
    )
    assert int8.weights.lm_head is int8.weights.embed  # tied: the int8 head, rows dequantized
    assert relative(all_logits(int8, PROMPT), want) < 3e-2
