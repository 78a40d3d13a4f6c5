"""Mixture-of-experts models against HF transformers: tiny random Mixtral, Qwen3-MoE (with a
dense layer from mlp_only_layers / decoder_sparse_step), OLMoE (QK-norm over the whole
projection) and Qwen2-MoE (shared expert) built and saved by transformers, loaded by pagedkern
from the folder: prefill and teacher-forced decode logits within fp32 tolerance, greedy tokens
equal through the Engine (whole and chunked prefill), and routing forced onto the same experts
for every token."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import all_logits, write_tokenizer
from test_model_transformers import PROMPT
from transformers_oracle import (
    assert_a_prefix_cache_hit_changes_nothing,
    assert_logprobs_follow,
    assert_preemption_and_batching_change_nothing,
    decode_logits,
    engine_greedy,
    hf_greedy,
    relative,
)

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig
from pagedkern.model import load_model

transformers = pytest.importorskip("transformers")

STEPS = 16
COMMON = dict(
    vocab_size=400,  # the tokenizer write_tokenizer trains
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
)


def _mixtral():
    return transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=5, num_experts_per_tok=2, **COMMON
    )


def _mixtral_window():
    # Mixtral's sliding window, on every layer as in Mistral
    return transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        **COMMON,
    )  # fmt: skip


def _qwen3_moe():
    # layer 1 dense (mlp_only_layers), layers 0 and 2 MoE; top-3 of 6, renormalised
    return transformers.Qwen3MoeConfig(
        head_dim=32, intermediate_size=80, moe_intermediate_size=40, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
        **COMMON,
    )  # fmt: skip


def _qwen3_moe_sparse_step():
    # decoder_sparse_step 2: only layer 1 ((1 + 1) % 2 == 0) is MoE; top-k = E
    return transformers.Qwen3MoeConfig(
        head_dim=16, intermediate_size=80, moe_intermediate_size=40, num_experts=3,
        num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, **COMMON,
    )  # fmt: skip


def _olmoe():
    return transformers.OlmoeConfig(
        intermediate_size=40, num_experts=7, num_experts_per_tok=2, norm_topk_prob=False, **COMMON
    )


def _qwen2_moe():
    return transformers.Qwen2MoeConfig(
        intermediate_size=80, moe_intermediate_size=32, shared_expert_intermediate_size=56,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **COMMON,
    )  # fmt: skip


ARCHITECTURES = {
    "mixtral": (_mixtral, "MixtralForCausalLM"),
    "mixtral_window": (_mixtral_window, "MixtralForCausalLM"),
    "qwen3_moe": (_qwen3_moe, "Qwen3MoeForCausalLM"),
    "qwen3_moe_step2": (_qwen3_moe_sparse_step, "Qwen3MoeForCausalLM"),
    "olmoe": (_olmoe, "OlmoeForCausalLM"),
    "qwen2_moe": (_qwen2_moe, "Qwen2MoeForCausalLM"),
}


def _save(folder, make_config, model_class, change=None):
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(make_config()).float().eval()
    if change is not None:
        change(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return hf


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def saved(request, tmp_path_factory):
    """(folder, the transformers model in fp32 eval mode, name) of one architecture."""
    make_config, model_class = ARCHITECTURES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return folder, _save(folder, make_config, model_class), request.param


def test_config_places_the_experts(saved):
    folder, hf, name = saved
    model, _ = load_model(str(folder), "cpu", torch.float32)
    cfg = model.config
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert moe == {"qwen3_moe": [0, 2], "qwen3_moe_step2": [1]}.get(name, [0, 1, 2])
    layer = model.weights.layers[moe[0]]
    assert layer.experts_gate_up.shape[0] == cfg.num_experts == hf.config.num_experts
    assert (layer.gate_up is not None) == (name == "qwen2_moe")  # the shared expert
    assert cfg.qk_norm_whole == (name == "olmoe")
    assert cfg.sliding_window == (6 if name == "mixtral_window" else None)


def test_prefill_and_decode_logits_equal_transformers(saved):
    folder, hf, _ = saved
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].double()
    got = all_logits(model, PROMPT).double()
    assert relative(got, want) < 1e-5, relative(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    tokens, want_steps = hf_greedy(hf, PROMPT, STEPS)
    with ops.use_backend("cpu"):  # the CPU backend's decode plan beside the MoE layers
        got_steps = decode_logits(model, PROMPT, tokens[:-1]).double()
    errors = [relative(g, w) for g, w in zip(got_steps, want_steps.double(), strict=True)]
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 8}], ids=["whole prefill", "chunked prefill"]
)
def test_greedy_decode_equals_transformers_token_for_token(saved, engine_args):
    folder, hf, _ = saved
    want_tokens, want_logits = hf_greedy(hf, PROMPT, STEPS)
    outputs = engine_greedy(folder, PROMPT, STEPS, **engine_args)
    assert_logprobs_follow(outputs, want_tokens, want_logits)


def test_a_prefix_cache_hit_changes_nothing(saved):
    folder, hf, _ = saved
    assert_a_prefix_cache_hit_changes_nothing(folder, hf, PROMPT)


def test_preemption_and_batching_change_nothing(saved):
    # Four sequences in a pool that holds two: preempted, recomputed, and batched with each
    # other (their tokens routed and grouped by expert together).
    folder, hf, name = saved
    # A window releases the blocks behind it: a smaller pool and 8-token prefill chunks.
    window = {"num_blocks": 10, "max_num_batched_tokens": 8} if name == "mixtral_window" else {}
    assert_preemption_and_batching_change_nothing(folder, hf, PROMPT, **window)


def _zero_routers(hf):
    # every router row zero: equal logits, so every token picks the same top-k experts and the
    # others get none. Which k is a tie rule: transformers' is torch.topk's (unspecified: it
    # depends on E and the device), pagedkern's the lower ids (reference.moe_route, the same in
    # the CUDA router); every expert of a layer holds the same weights, so both pick equal ones
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith((".mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.zero_()
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                p[1:] = p[0]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_routing_every_token_to_the_same_experts(tmp_path, arch):
    make_config, model_class = ARCHITECTURES[arch]
    hf = _save(tmp_path, make_config, model_class, _zero_routers)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    assert all(layer.router.abs().sum() == 0 for layer in model.weights.layers)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].double()
    got = all_logits(model, PROMPT).double()
    assert relative(got, want) < 1e-5
    tokens, want_steps = hf_greedy(hf, PROMPT, 8)
    got_steps = decode_logits(model, PROMPT, tokens[:-1]).double()
    assert max(relative(g, w) for g, w in zip(got_steps, want_steps.double(), strict=True)) < 1e-5


def test_num_parameters_counts_what_transformers_holds(saved):
    folder, hf, _ = saved
    model, _ = load_model(str(folder), "cpu", torch.float32)
    # (num_parameters leaves biases out, for every family)
    weights = [p for name, p in hf.named_parameters() if not name.endswith(".bias")]
    assert model.config.num_parameters() == sum(p.numel() for p in weights)


def test_the_qwen3_30b_a3b_preset_has_its_shape():
    from pagedkern.model import PRESETS

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    preset = PRESETS["qwen3-30b-a3b"]
    assert preset.num_parameters() == sum(p.numel() for p in hf.parameters())
    # a token reads its 8 of 128 experts: the "A3B" of the name (3.3 B active of 30.5 B)
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    assert preset.num_parameters(active=True) == preset.num_parameters() - experts * 120 // 128
    assert 3.2e9 < preset.num_parameters(active=True) < 3.4e9


def test_a_synthetic_moe_model_decodes_as_it_prefills():
    # a synthetic MoE config (some layers dense, a shared expert, whole-projection QK-norm):
    # each decode step's logits equal the prefill's logits at that position
    from pagedkern.model import PRESETS

    config = PRESETS["tiny"].replace(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, dense_layers=(1,),
        shared_expert_size=40, qk_norm=True, qk_norm_whole=True, norm_topk_prob=False,
    )  # fmt: skip
    model, _ = load_model(config, "cpu", torch.float32, seed=3)
    assert model.weights.layers[0].experts_gate_up.shape == (5, 48, 64)
    assert model.weights.layers[1].router is None
    ids = [5, 77, 301, 12, 250, 9, 33, 120]
    prefill = all_logits(model, ids).double()
    steps = decode_logits(model, ids[:4], ids[4:]).double()
    assert max(relative(g, w) for g, w in zip(steps, prefill[3:], strict=True)) < 1e-5


def test_cuda_graphs_are_refused_for_moe_models(saved):
    # the reference MoE op reads expert counts back to the host: not capturable
    folder, _, _ = saved
    config = EngineConfig(model=str(folder), backend="reference", cuda_graphs=True)
    with pytest.raises(ValueError, match="fused_moe"):
        Engine.from_config(config)
