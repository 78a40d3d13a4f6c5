"""gpt-oss against HF transformers: a tiny random GptOssForCausalLM (3 layers alternating
sliding-window (8) and full attention, per-head sinks, q/k/v/o biases, YaRN RoPE, 6 experts
top-2 with a router bias, expert biases and the clamped SwiGLU at a limit low enough to clamp)
saved by transformers and loaded by pagedkern from the folder: prefill and decode logits within
fp32 tolerance over a prompt longer than the window, greedy tokens equal through the Engine
(whole and chunked prefill, a prefix-cache hit, preemption and batching), through LLM and the
CLI; every token routed to the same two experts (the others idle); the same model with its
experts in MXFP4 (as released checkpoints store them) loads equal to it."""

from __future__ import annotations

import json

import pytest
import torch
from hf_model_files import all_logits, write_tokenizer
from mxfp4_quantizer import quantize_mxfp4, representable
from safetensors.torch import load_file, save_file
from test_model_transformers import PROMPT
from transformers_oracle import (
    assert_a_prefix_cache_hit_changes_nothing,
    assert_logprobs_follow,
    assert_preemption_and_batching_change_nothing,
    decode_logits,
    hf_greedy,
    relative,
)

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import load_model
from pagedkern.model.config import FULL, SLIDING

transformers = pytest.importorskip("transformers")

STEPS = 16
WINDOW = 8
LONG_PROMPT = PROMPT + PROMPT[::-1][:9]  # 29 tokens: well past the window


def _config(**changes):
    fields = dict(
        vocab_size=400,  # the tokenizer write_tokenizer trains
        hidden_size=64,
        intermediate_size=32,  # each expert's
        num_hidden_layers=3,  # sliding, full, sliding (transformers' default layer_types)
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=64,  # = factor * original: transformers warns otherwise
        rms_norm_eps=1e-5,
        swiglu_limit=1.5,  # the clamps act on a good share of gate / up values
        initializer_range=0.2,  # peaked logits: greedy choices far from ties
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },  # fmt: skip
    )
    return transformers.GptOssConfig(**(fields | changes))


def _randomise_biases(hf):
    # transformers initialises the expert biases to zero: random ones, so a misplaced one shows
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def save(folder, change=None, **config_changes):
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(_config(**config_changes)).float().eval()
    _randomise_biases(hf)
    if change is not None:
        change(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    return folder, save(folder)


def test_config_reads_every_gpt_oss_feature(saved):
    folder, hf = saved
    model, _ = load_model(str(folder), "cpu", torch.float32)
    cfg = model.config
    assert cfg.layer_types == (SLIDING, FULL, SLIDING) and cfg.sliding_window == WINDOW
    assert cfg.attn_sinks and cfg.router_bias and cfg.expert_bias
    assert cfg.moe_scoring == "softmax_topk" and cfg.swiglu_limit == 1.5
    assert cfg.qkv_bias and cfg.o_bias
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.truncate is False
    layer = model.weights.layers[0]
    assert layer.sinks.dtype == torch.float32
    torch.testing.assert_close(layer.sinks, hf.model.layers[0].self_attn.sinks.detach())
    # the interleaved gate/up columns de-interleaved into gate rows, then up rows
    experts = hf.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)
    assert torch.equal(layer.experts_gate_up[:, :32], gate_up[:, 0::2])
    assert torch.equal(layer.experts_gate_up[:, 32:], gate_up[:, 1::2])
    assert torch.equal(layer.experts_gate_up_bias[:, 32:], experts.gate_up_proj_bias[:, 1::2])


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_table_equals_transformers_rotary_embedding(truncate):
    from pagedkern.model.hf_config import config_from_hf
    from pagedkern.model.rope import rope_table

    hf_config = _config(rope_parameters={**_config().rope_parameters, "truncate": truncate})
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf_config)
    positions = torch.arange(100)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cfg = config_from_hf(hf_config.to_dict(), "test")
    table = rope_table(cfg, 100, "cpu")
    assert rotary.attention_scaling > 1  # (YaRN's factor applies)
    torch.testing.assert_close(table, torch.cat([cos[0], sin[0]], -1), rtol=2e-5, atol=2e-5)


def test_prefill_and_decode_logits_equal_transformers(saved):
    folder, hf = saved
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    with torch.no_grad():
        want = hf(torch.tensor([LONG_PROMPT])).logits[0].double()
    got = all_logits(model, LONG_PROMPT).double()
    assert relative(got, want) < 1e-5, relative(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    tokens, want_steps = hf_greedy(hf, LONG_PROMPT, STEPS)
    with ops.use_backend("cpu"):  # sinks and windows: the CPU backend's one-shot ops
        got_steps = decode_logits(model, LONG_PROMPT, tokens[:-1]).double()
    errors = [relative(g, w) for g, w in zip(got_steps, want_steps.double(), strict=True)]
    assert max(errors) < 1e-5, errors


def test_sinks_and_biases_matter(saved):
    # the comparison above can fail: zeroing the sinks (or the router bias) moves the logits
    folder, _ = saved
    model, _ = load_model(str(folder), "cpu", torch.float32)
    base = all_logits(model, LONG_PROMPT)
    for field in ("sinks", "router_bias", "experts_down_bias"):
        changed, _ = load_model(str(folder), "cpu", torch.float32)
        for layer in changed.weights.layers:
            getattr(layer, field).zero_()
        assert relative(all_logits(changed, LONG_PROMPT), base.double()) > 1e-3, field


@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 8}], ids=["whole prefill", "chunked prefill"]
)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_greedy_decode_equals_transformers_token_for_token(saved, engine_args, backend):
    folder, hf = saved
    want_tokens, want_logits = hf_greedy(hf, LONG_PROMPT, STEPS)
    config = dict(
        model=str(folder), backend=backend, dtype="float32", kv_cache_dtype="float32",
        num_blocks=64, block_size=4,
    )  # fmt: skip
    engine = Engine.from_config(EngineConfig(**config, **engine_args))
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(prompt_ids=LONG_PROMPT, params=params)
    assert_logprobs_follow(list(engine.run_until_done()), want_tokens, want_logits)


def test_a_prefix_cache_hit_changes_nothing(saved):
    folder, hf = saved
    assert_a_prefix_cache_hit_changes_nothing(folder, hf, LONG_PROMPT)


def test_preemption_and_batching_change_nothing(saved):
    folder, hf = saved
    # four sequences of 41 tokens (11 blocks each) in 28 blocks, prefilled in 8-token chunks
    args = dict(num_blocks=28, max_num_batched_tokens=8)
    assert_preemption_and_batching_change_nothing(folder, hf, LONG_PROMPT, **args)


def test_llm_and_cli_answer_as_transformers(saved, capsys):
    from pagedkern.engine import LLM
    from pagedkern.serving.cli import main

    folder, hf = saved
    llm = LLM(str(folder), backend="reference", num_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    (out,) = llm.generate("the capital of France is", params, use_tqdm=False)
    assert list(out.token_ids) == hf_greedy(hf, out.prompt_token_ids, 6)[0]
    args = ["--model", str(folder), "--max-tokens", "6", "--ignore-eos", "--backend", "reference",
            "--raw"]  # fmt: skip
    assert main([*args, "the capital of France is"]) in (0, None)
    assert capsys.readouterr().out.strip() == out.text.strip()


def _route_every_token_to_experts_4_and_1(hf):
    # router weights zero, its bias picks experts 4 then 1 for every token (no tie to break):
    # one pair of experts takes every token, the other four none
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.router.weight.zero_()
            layer.mlp.router.bias.copy_(torch.tensor([0.0, 1.5, -1.0, 0.5, 2.0, -2.0]))


def test_every_token_routed_to_the_same_two_experts(tmp_path):
    hf = save(tmp_path, _route_every_token_to_experts_4_and_1)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    with torch.no_grad():
        want = hf(torch.tensor([LONG_PROMPT])).logits[0].double()
    assert relative(all_logits(model, LONG_PROMPT).double(), want) < 1e-5
    tokens, want_steps = hf_greedy(hf, LONG_PROMPT, 8)
    got_steps = decode_logits(model, LONG_PROMPT, tokens[:-1]).double()
    assert max(relative(g, w) for g, w in zip(got_steps, want_steps.double(), strict=True)) < 1e-5


def _mxfp4_experts(hf):
    # every expert weight rounded onto the MXFP4 grid (so the MXFP4 folder holds it exactly)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(representable(p.transpose(1, 2)).transpose(1, 2))


def test_mxfp4_experts_load_equal_to_the_float_folder(tmp_path):
    float_folder, mx_folder = tmp_path / "float", tmp_path / "mxfp4"
    hf = save(float_folder, _mxfp4_experts)
    save(mx_folder, _mxfp4_experts)
    tensors = load_file(str(mx_folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # rows = outputs
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(mx_folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mx_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}  # as released checkpoints say
    (mx_folder / "config.json").write_text(json.dumps(config))

    want, _ = load_model(str(float_folder), "cpu", torch.float32, kv_cache_dtype="float32")
    got, _ = load_model(str(mx_folder), "cpu", torch.float32, kv_cache_dtype="float32")
    for a, b in zip(want.weights.layers, got.weights.layers, strict=True):
        assert torch.equal(a.experts_gate_up, b.experts_gate_up)
        assert torch.equal(a.experts_down, b.experts_down)
    assert torch.equal(all_logits(got, LONG_PROMPT), all_logits(want, LONG_PROMPT))
    with torch.no_grad():
        hf_want = hf(torch.tensor([LONG_PROMPT])).logits[0].double()
    assert relative(all_logits(got, LONG_PROMPT).double(), hf_want) < 1e-5
    bf16, _ = load_model(str(mx_folder), "cpu", torch.bfloat16)  # dequantized straight to bf16
    got_down = bf16.weights.layers[1].experts_down
    assert torch.equal(got_down.float(), want.weights.layers[1].experts_down)
