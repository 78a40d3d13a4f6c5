"""HF transformers as the reference implementation: tiny random models of each supported
architecture built and saved by transformers itself, loaded by pagedkern from the folder (and
from a GGUF written the way llama.cpp's converter writes that architecture), must give
transformers' logits (fp32, prefill and every greedy decode step) and its greedy continuation
token for token, through the engine with chunked prefill and prefix-cache hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_model_files import finish_gguf, gguf_writer_like_llama_cpp, write_tokenizer
from test_model_gguf import llama_cpp_permute, llama_cpp_tensor_name
from transformers_oracle import (
    assert_a_prefix_cache_hit_changes_nothing,
    assert_logprobs_follow,
    decode_logits,
    engine_greedy,
    hf_greedy,
    relative,
)

from pagedkern.model import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 400  # the tokenizer write_tokenizer trains
PROMPT = [5, 77, 301, 12, 250, 9, 33, 120, 64, 7, 199, 3, 42, 318, 91, 17, 260, 88, 2, 150]
STEPS = 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
)


def _qwen3():
    return transformers.Qwen3Config(head_dim=32, rope_theta=1e6, **COMMON)


def _llama():
    return transformers.LlamaConfig(rope_theta=10000.0, **COMMON)


ARCHITECTURES = {
    "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
    "llama": (_llama, transformers.LlamaForCausalLM),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def saved(request, tmp_path_factory):
    """(folder, the transformers model in fp32 eval mode) of one architecture."""
    make_config, model_class = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    model = model_class(make_config()).float().eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder, model


def test_prefill_logits_equal_transformers(saved):
    folder, hf = saved
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].double()
    from hf_model_files import all_logits

    got = all_logits(model, PROMPT).double()
    error = ((got - want).norm() / want.norm()).item()
    assert error < 1e-5, error
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 8},  # the prompt prefilled in chunks
    ],
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


def write_gguf_like_llama_cpp(path, hf, arch: str) -> None:
    """The transformers model as llama.cpp's convert_hf_to_gguf.py writes it, in F32: its
    tensor names, Q/K permuted for interleaved RoPE on "llama" only, head dim as key_length."""
    cfg = hf.config
    w = gguf_writer_like_llama_cpp(path, cfg, arch, cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    for name, t in hf.state_dict().items():
        arr = np.ascontiguousarray(t.float().numpy())
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            arr = llama_cpp_permute(arr, heads)
        w.add_tensor(llama_cpp_tensor_name(name), arr)
    finish_gguf(w)


def test_the_gguf_llama_cpp_writes_equals_transformers(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))
    folder, hf = saved
    arch = hf.config.model_type  # "llama" or "qwen3", as llama.cpp names them too
    path = tmp_path / "m.gguf"
    write_gguf_like_llama_cpp(path, hf, arch)
    model, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="none"
    )
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].double()
    from hf_model_files import all_logits

    got = all_logits(model, PROMPT).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert model.config.qk_norm == (arch == "qwen3")


def _mistral(**changes):
    return transformers.MistralConfig(**{**COMMON, "head_dim": 16, "sliding_window": 6, **changes})


def _qwen2_sliding(**changes):
    config = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return transformers.Qwen2Config(**{**COMMON, **config, **changes})  # layers 1, 2 windowed


@pytest.mark.parametrize(
    "make_config, model_class",
    [(_mistral, "MistralForCausalLM"), (_qwen2_sliding, "Qwen2ForCausalLM")],
    ids=["mistral", "qwen2"],
)
def test_sliding_window_llama_family_equals_transformers(tmp_path, make_config, model_class):
    # Mistral's window on every layer, Qwen2's from max_window_layers on: prefill and decode
    # logits (each step through paged_attention) against transformers', whose logits the
    # window changes.
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(make_config()).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    assert model.config.sliding_window == 6
    tokens, want = hf_greedy(hf, PROMPT, 8)
    got = decode_logits(model, PROMPT, tokens[:-1]).double()
    assert max(relative(g, w) for g, w in zip(got, want.double(), strict=True)) < 1e-5
    torch.manual_seed(0)
    full = getattr(transformers, model_class)(make_config(sliding_window=1000)).float().eval()
    assert relative(hf_greedy(full, PROMPT, 8)[1], want.double()) > 1e-2
