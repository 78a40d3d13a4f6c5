"""Every supported HF architecture against transformers over randomized, seeded configurations.

The family tests (test_model_transformers, _gemma, _moe, _gpt_oss) pin one or two tiny shapes
each; real checkpoints vary in every config key pagedkern reads. Here a `random.Random` seeded by
family and number draws each family's keys over the values real checkpoints use (head_dim apart
from hidden / heads, MHA to GQA 8 and MQA, odd sizes, tied or untied embeddings, each RoPE
scaling the family's rotary embedding takes and its base, attention / MLP biases, sliding
windows and their per-layer patterns, Gemma's soft-caps and query_pre_attn_scalar, MoE top-k,
norm_topk_prob, shared experts, decoder_sparse_step, mlp_only_layers, rms_norm_eps, config.json
as written before transformers v5), transformers builds and saves the tiny model in fp32, and
pagedkern loads the folder in fp32. Its prefill logits over a prompt longer than any window and
its logits at each of a few greedy decode steps (through paged_attention), on the reference ops
and on the CPU backend, must be transformers' in float64 as closely as transformers' own fp32
logits are (1e-5 relative, more only where transformers' fp32 strays more), with equal argmax.
A config pagedkern does not support must be refused with a ModelLoadError naming what it
refuses: silently wrong logits are the outcome these tests exist to rule out. The default set
draws 5 configs per family; the slow sweep 25 more.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hf_model_files import all_logits, write_tokenizer
from transformers_oracle import decode_logits, hf_greedy, hf_logits, relative

from pagedkern import ops
from pagedkern.model import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")

VOCAB = 400  # the tokenizer write_tokenizer trains
# 30 tokens: past every window drawn below (at most 8), so every window hides some keys
PROMPT = [5, 77, 301, 12, 250, 9, 33, 120, 64, 7, 199, 3, 42, 318, 91, 17, 260, 88, 2, 150]
PROMPT += [44, 390, 123, 8, 271, 60, 14, 333, 99, 21]
DECODE_STEPS = 5
TOLERANCE = 1e-5


@dataclass
class Case:
    """One drawn configuration: the transformers class and its config keys, and, where
    pagedkern refuses the config, what its ModelLoadError must name (a regex)."""

    model_class: str
    config: dict[str, Any]
    refused: str | None = None
    # config.json as transformers v4 wrote it: no layer_types, the families' rules derive them
    legacy: bool = False


# ---- the draws shared by every family --------------------------------------------------------


def _attention_shape(rng: random.Random, head_dim_free: bool = True) -> dict[str, Any]:
    """Heads (MHA, GQA 2..8, MQA), KV heads, hidden and the other sizes; head_dim_free: a
    head_dim mostly apart from hidden / heads, else hidden / heads (for families whose
    attention derives it)."""
    kv_heads = rng.choice([1, 1, 2, 3, 4])
    group = rng.choice([1, 1, 2, 3, 4, 8])
    heads = min(kv_heads * group, 16)
    heads -= heads % kv_heads
    head_dim = rng.choice([8, 12, 16, 20, 32])
    # (transformers' configs check hidden % heads, even where head_dim is its own key)
    multiples = [m for m in range(2, 129) if 16 <= heads * m <= 128]
    hidden = heads * rng.choice(multiples)
    if not head_dim_free or rng.random() < 0.3:
        head_dim = hidden // heads + hidden // heads % 2  # (the shape head_dim_free lacks)
        hidden = heads * head_dim
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=rng.choice([1, 2, 3]),
        intermediate_size=rng.choice([24, 40, 64, 96, 136]),
        rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-2]),
        tie_word_embeddings=rng.random() < 0.4,
        max_position_embeddings=256,
        initializer_range=0.2,  # peaked logits: greedy choices far from ties
    )


def _rope(rng: random.Random, kinds: tuple[str, ...]) -> tuple[dict[str, Any], str | None]:
    """(rope_parameters, the word of its refusal or None): a base and one scaling of `kinds`
    ("dynamic" and "longrope": transformers' rotary embeddings take them, pagedkern refuses)."""
    theta = rng.choice([100.0, 10000.0, 500000.0, 1e6])
    kind = rng.choice(kinds)
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": theta}
    factor = rng.choice([2.0, 4.0, 8.0])
    if kind == "linear":
        rope["factor"] = factor
    elif kind == "llama3":
        low = rng.choice([0.5, 1.0, 2.0])
        rope |= dict(
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=low * rng.choice([2.0, 4.0]),
            original_max_position_embeddings=rng.choice([16, 32, 64]),
        )
    elif kind == "yarn":
        rope |= dict(
            factor=factor,
            original_max_position_embeddings=rng.choice([16, 32, 64]),
            beta_fast=rng.choice([8.0, 32.0]),
            beta_slow=rng.choice([0.5, 1.0, 2.0]),
        )
        if rng.random() < 0.5:
            rope["truncate"] = rng.random() < 0.5
        if rng.random() < 0.3:
            rope["attention_factor"] = rng.choice([0.8, 1.3])
    elif kind == "dynamic":
        rope["factor"] = factor
    elif kind == "longrope":
        return rope, "longrope"  # (filled in by the caller, which knows head_dim)
    return rope, {"dynamic": "dynamic"}.get(kind)


def _longrope_factors(rng: random.Random, rope: dict[str, Any], head_dim: int) -> None:
    half = head_dim // 2
    rope["short_factor"] = [round(rng.uniform(1.0, 2.0), 3) for _ in range(half)]
    rope["long_factor"] = [round(rng.uniform(1.0, 8.0), 3) for _ in range(half)]
    rope["original_max_position_embeddings"] = 64
    rope["factor"] = 4.0


def _with_rope(rng: random.Random, cfg: dict, kinds: tuple[str, ...]) -> str | None:
    rope, refused = _rope(rng, kinds)
    if rope["rope_type"] == "longrope":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        _longrope_factors(rng, rope, head_dim)
    cfg["rope_parameters"] = rope
    return refused


def _window(rng: random.Random) -> int:
    return rng.choice([2, 3, 5, 8])


DENSE_ROPE = ("default", "default", "linear", "llama3", "yarn", "dynamic", "longrope")


# ---- one generator per family ----------------------------------------------------------------


def _llama(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    refused = _with_rope(rng, cfg, DENSE_ROPE)
    cfg["attention_bias"] = rng.random() < 0.3
    cfg["mlp_bias"] = rng.random() < 0.3
    if rng.random() < 0.15:
        cfg["hidden_act"] = "gelu"
        refused = "|".join(filter(None, (refused, "activation")))
    return Case("LlamaForCausalLM", cfg, refused)


def _mistral(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    refused = _with_rope(rng, cfg, DENSE_ROPE)
    cfg["sliding_window"] = _window(rng) if rng.random() < 0.7 else None
    return Case("MistralForCausalLM", cfg, refused)


def _qwen_windows(rng: random.Random, cfg: dict) -> None:
    """Qwen2 / Qwen3's window: only with use_sliding_window, from max_window_layers on."""
    cfg["use_sliding_window"] = rng.random() < 0.6
    cfg["sliding_window"] = _window(rng)
    cfg["max_window_layers"] = rng.randrange(cfg["num_hidden_layers"] + 1)


def _qwen2(rng: random.Random) -> Case:
    cfg = _attention_shape(rng, head_dim_free=False)
    del cfg["head_dim"]  # (Qwen2's attention derives it: hidden // heads)
    refused = _with_rope(rng, cfg, DENSE_ROPE)
    _qwen_windows(rng, cfg)
    return Case("Qwen2ForCausalLM", cfg, refused)


def _qwen3(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    refused = _with_rope(rng, cfg, DENSE_ROPE)
    cfg["attention_bias"] = rng.random() < 0.3
    _qwen_windows(rng, cfg)
    return Case("Qwen3ForCausalLM", cfg, refused)


def _gemma_common(rng: random.Random, cfg: dict) -> None:
    cfg["query_pre_attn_scalar"] = rng.choice([cfg["head_dim"], 24, 256])
    cfg["sliding_window"] = _window(rng)
    cfg["tie_word_embeddings"] = rng.random() < 0.7
    cfg["attention_bias"] = rng.random() < 0.2
    if rng.random() < 0.5:  # an explicit pattern; else the family's default
        cfg["layer_types"] = [
            rng.choice(["sliding_attention", "full_attention"])
            for _ in range(cfg["num_hidden_layers"])
        ]
    cfg["final_logit_softcapping"] = rng.choice([None, 3.0, 30.0])


def _gemma2(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    _gemma_common(rng, cfg)
    cfg["attn_logit_softcapping"] = rng.choice([None, 1.0, 50.0])
    refused = _with_rope(rng, cfg, ("default", "default", "linear", "llama3", "yarn"))
    return Case("Gemma2ForCausalLM", cfg, refused)


def _gemma3(rng: random.Random) -> Case:
    cfg = _attention_shape(rng, head_dim_free=True)
    # (Gemma3TextConfig checks hidden % heads; head_dim stays free)
    cfg["hidden_size"] = cfg["num_attention_heads"] * rng.choice([4, 6, 8])
    _gemma_common(rng, cfg)
    full, refused = _rope(rng, ("default", "linear", "linear", "llama3", "yarn", "dynamic"))
    # transformers' YaRN reads truncate from the top of rope_parameters, which for Gemma 3 holds
    # the per-layer-kind dicts: it ignores the full-attention RoPE's own truncate (pagedkern
    # honours it), so it stays at its default here
    full.pop("truncate", None)
    local = {"rope_type": "default", "rope_theta": rng.choice([10.0, 10000.0])}
    cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    if "layer_types" not in cfg:
        cfg["sliding_window_pattern"] = rng.choice([2, 3, 6])
    return Case("Gemma3ForCausalLM", cfg, refused)


def _experts(rng: random.Random, cfg: dict) -> None:
    experts = rng.choice([2, 3, 4, 6, 8])
    cfg["num_experts"] = experts
    cfg["num_experts_per_tok"] = rng.randint(1, min(experts, 4))
    cfg["norm_topk_prob"] = rng.random() < 0.5


def _mixtral(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    refused = _with_rope(rng, cfg, ("default", "linear", "llama3", "yarn"))
    _experts(rng, cfg)
    cfg["num_local_experts"] = cfg.pop("num_experts")
    del cfg["norm_topk_prob"]  # (Mixtral always renormalises)
    cfg["sliding_window"] = _window(rng) if rng.random() < 0.5 else None
    return Case("MixtralForCausalLM", cfg, refused)


def _qwen_moe_layers(rng: random.Random, cfg: dict) -> None:
    cfg["moe_intermediate_size"] = rng.choice([16, 24, 40])
    cfg["decoder_sparse_step"] = rng.choice([1, 1, 2])
    layers = cfg["num_hidden_layers"]
    cfg["mlp_only_layers"] = sorted(rng.sample(range(layers), rng.randint(0, layers - 1)))


def _qwen2_moe(rng: random.Random) -> Case:
    cfg = _attention_shape(rng, head_dim_free=False)
    del cfg["head_dim"]
    refused = _with_rope(rng, cfg, ("default", "linear", "yarn"))
    _experts(rng, cfg)
    _qwen_moe_layers(rng, cfg)
    cfg["shared_expert_intermediate_size"] = rng.choice([16, 48])
    cfg["qkv_bias"] = rng.random() < 0.8
    _qwen_windows(rng, cfg)
    return Case("Qwen2MoeForCausalLM", cfg, refused)


def _qwen3_moe(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    refused = _with_rope(rng, cfg, ("default", "linear", "yarn"))
    _experts(rng, cfg)
    _qwen_moe_layers(rng, cfg)
    cfg["attention_bias"] = rng.random() < 0.2
    _qwen_windows(rng, cfg)
    return Case("Qwen3MoeForCausalLM", cfg, refused)


def _olmoe(rng: random.Random) -> Case:
    cfg = _attention_shape(rng, head_dim_free=False)
    del cfg["head_dim"]
    refused = _with_rope(rng, cfg, ("default", "linear", "yarn"))
    _experts(rng, cfg)
    cfg["attention_bias"] = rng.random() < 0.2
    if rng.random() < 0.15:
        cfg["clip_qkv"] = 1.0
        refused = "|".join(filter(None, (refused, "clip_qkv")))
    return Case("OlmoeForCausalLM", cfg, refused)


def _gpt_oss(rng: random.Random) -> Case:
    cfg = _attention_shape(rng)
    rope, _ = _rope(rng, ("yarn",))
    cfg["rope_parameters"] = rope
    _experts(rng, cfg)
    cfg["num_local_experts"] = cfg.pop("num_experts")
    del cfg["norm_topk_prob"]  # (softmax over the top-k: sums to 1)
    cfg["sliding_window"] = _window(rng)
    if rng.random() < 0.5:
        cfg["layer_types"] = [
            rng.choice(["sliding_attention", "full_attention"])
            for _ in range(cfg["num_hidden_layers"])
        ]
    cfg["swiglu_limit"] = rng.choice([1.0, 7.0])
    cfg["attention_bias"] = rng.random() < 0.8
    return Case("GptOssForCausalLM", cfg)


FAMILIES: dict[str, tuple[str, Callable[[random.Random], Case]]] = {
    "llama": ("LlamaConfig", _llama),
    "mistral": ("MistralConfig", _mistral),
    "qwen2": ("Qwen2Config", _qwen2),
    "qwen3": ("Qwen3Config", _qwen3),
    "gemma2": ("Gemma2Config", _gemma2),
    "gemma3": ("Gemma3TextConfig", _gemma3),
    "mixtral": ("MixtralConfig", _mixtral),
    "qwen2_moe": ("Qwen2MoeConfig", _qwen2_moe),
    "qwen3_moe": ("Qwen3MoeConfig", _qwen3_moe),
    "olmoe": ("OlmoeConfig", _olmoe),
    "gpt_oss": ("GptOssConfig", _gpt_oss),
}


MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# Families whose configs derive layer_types when config.json lacks them (written before v5)
DERIVED_LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3", "gpt_oss")


def draw(family: str, seed: int) -> Case:
    rng = random.Random(f"{family}-{seed}")
    case = FAMILIES[family][1](rng)
    if family in DERIVED_LAYER_TYPES and "layer_types" not in case.config:
        case.legacy = rng.random() < 0.3
    if case.legacy and family == "qwen2_moe" and case.config["use_sliding_window"]:
        case.refused = "|".join(filter(None, (case.refused, "layer_types")))
    return case


# ---- building, loading and comparing ---------------------------------------------------------


def _randomise_small_parameters(hf) -> None:
    """transformers starts norms at 1 (Gemma's at 0), biases and sinks at 0: random ones, so a
    misplaced or dropped one changes the logits."""
    g = torch.Generator().manual_seed(1)
    gemma = hf.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _eager_experts(hf) -> None:
    # transformers' default grouped expert GEMM wants 16-byte strides: no odd hidden sizes
    if hf.config.model_type in MOE:
        hf.set_experts_implementation("eager")


def _as_written_before_v5(case: Case, folder) -> None:
    """config.json without layer_types (Gemma 3: its sliding_window_pattern instead)."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    del raw["layer_types"]
    if "sliding_window_pattern" in case.config:
        raw["sliding_window_pattern"] = case.config["sliding_window_pattern"]
    path.write_text(json.dumps(raw))


def build(family: str, case: Case, folder) -> Any:
    """The transformers model of `case` (fp32, eval mode), saved with the test tokenizer. A
    legacy case's is what transformers makes of the config.json without layer_types."""
    config = getattr(transformers, FAMILIES[family][0])(**case.config)
    torch.manual_seed(0)
    hf = getattr(transformers, case.model_class)(config).float().eval()
    _eager_experts(hf)
    _randomise_small_parameters(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    if case.legacy:
        _as_written_before_v5(case, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        _eager_experts(hf)
    return hf.eval()


def _tolerances(hf, want: torch.Tensor, ids: list[int]) -> list[float]:
    """Per logits row of `ids`: TOLERANCE, or more where transformers' own fp32 logits stray
    further from its float64 ones `want` (an ill-conditioned draw: a 1-head layer whose softmax
    turns on a near-tie, eps 1e-2 norms over small activations), up to 4x that stray.
    pagedkern's fp32 is held to float64 as closely as transformers' own fp32 is."""
    fp32 = hf_logits(hf, ids)
    return [max(TOLERANCE, 4 * relative(g, w)) for g, w in zip(fp32, want, strict=True)]


def check_against_transformers(family: str, seed: int, folder) -> None:
    case = draw(family, seed)
    hf = build(family, case, folder)
    if case.refused is not None:
        with pytest.raises(ModelLoadError, match=case.refused):
            load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
        return
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    tokens, _ = hf_greedy(hf, PROMPT, DECODE_STEPS)
    hf64 = copy.deepcopy(hf).double()  # the oracle: transformers in float64
    # (causal: the teacher-forced sequence's rows are the prefill's, then each decode step's)
    teacher_forced = PROMPT + tokens[:-1]
    want_all = hf_logits(hf64, teacher_forced)
    want, want_steps = want_all[: len(PROMPT)], want_all[len(PROMPT) - 1 :]
    tolerances = _tolerances(hf, want_all, teacher_forced)
    prefill_tolerance = max(tolerances[: len(PROMPT)])
    step_tolerances = tolerances[len(PROMPT) - 1 :]
    for backend in ("reference", "cpu"):
        with ops.use_backend(backend):
            got = all_logits(model, PROMPT).double()
            got_steps = decode_logits(model, PROMPT, tokens[:-1]).double()
        error = relative(got, want)
        assert error < prefill_tolerance, (backend, "prefill", error, case)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (backend, "prefill", case)
        errors = [relative(g, w) for g, w in zip(got_steps, want_steps, strict=True)]
        assert all(map(float.__lt__, errors, step_tolerances)), (backend, errors, case)
        assert torch.equal(got_steps.argmax(-1), want_steps.argmax(-1)), (backend, case)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_configs_give_transformers_logits(family: str, seed: int, tmp_path) -> None:
    check_against_transformers(family, seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5, 30))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_more_random_configs_give_transformers_logits(family: str, seed: int, tmp_path) -> None:
    check_against_transformers(family, seed, tmp_path)


# ---- the mismatches the sweep found, each pinned by one plain config -------------------------


def _qwen3_moe_config(**changes) -> dict[str, Any]:
    config = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        initializer_range=0.2,
    )  # fmt: skip
    return config | changes


def test_qwen3_moe_windows_every_layer_whatever_max_window_layers_says(tmp_path) -> None:
    # Qwen3-MoE's attention takes sliding_window on every layer once use_sliding_window is set:
    # its config has no layer_types, and transformers reads no max_window_layers for it (a
    # Qwen2 / Qwen3 rule, which would leave both layers here unwindowed)
    case = Case(
        "Qwen3MoeForCausalLM",
        _qwen3_moe_config(use_sliding_window=True, sliding_window=4, max_window_layers=2),
    )
    hf = build("qwen3_moe", case, tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    assert model.config.layer_types == ("sliding", "sliding")
    assert model.config.sliding_window == 4
    want = hf_logits(hf, PROMPT)
    assert relative(all_logits(model, PROMPT), want) < 1e-5


def test_a_qwen_moe_config_with_every_layer_dense_loads_as_a_dense_model(tmp_path) -> None:
    # decoder_sparse_step 2 over one layer: layer 0 is a plain MLP ((0 + 1) % 2 != 0), so the
    # checkpoint holds no expert tensor at all
    case = Case(
        "Qwen3MoeForCausalLM", _qwen3_moe_config(num_hidden_layers=1, decoder_sparse_step=2)
    )
    hf = build("qwen3_moe", case, tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    assert model.config.num_experts == 0 and model.config.qk_norm
    assert relative(all_logits(model, PROMPT), hf_logits(hf, PROMPT)) < 1e-5


def test_a_windowed_qwen2_moe_config_without_layer_types_is_refused(tmp_path) -> None:
    # Which layers such a config windows differs between transformers versions (v5: every other
    # one below max_window_layers; v4: those from it on): refused rather than guessed
    cfg = _qwen3_moe_config(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    cfg |= dict(shared_expert_intermediate_size=16)
    del cfg["head_dim"]
    case = Case("Qwen2MoeForCausalLM", cfg, legacy=True)
    build("qwen2_moe", case, tmp_path)
    with pytest.raises(ModelLoadError, match="layer_types"):
        load_model(str(tmp_path), "cpu", torch.float32)
