"""HF model folders the tests write themselves (random weights saved with safetensors, a small
byte-level BPE tokenizer trained with `tokenizers`), checked against a dense float64 forward
written here with HF's conventions (rotate-half RoPE, Llama 3 frequency scaling, biases)."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import all_logits, base_config, dense_logits, write_folder
from safetensors.torch import load_file, save_file

from pagedkern.model import ModelLoadError, load_model
from pagedkern.model.hf_loader import hf_checkpoint_dtype

CASES = {
    # Llama 3: untied head, sharded checkpoint, Llama 3 RoPE scaling that matters at these
    # positions (original context 16).
    "llama3-sharded": (
        base_config(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        3,
        torch.float32,
    ),
    # Qwen2: q/k/v bias, tied embeddings, bf16 checkpoint.
    "qwen2-tied-bf16": (
        base_config(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            torch_dtype="bfloat16",
            sliding_window=4096,  # as in real Qwen2 configs: off unless use_sliding_window
            use_sliding_window=False,
        ),
        1,
        torch.bfloat16,
    ),
    # Llama 2-style with every bias, linear RoPE scaling and head_dim != hidden / heads.
    "llama-bias-linear": (
        base_config(
            attention_bias=True,
            mlp_bias=True,
            head_dim=32,
            rope_scaling={"type": "linear", "factor": 2.0},
        ),
        2,
        torch.float32,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_folder_matches_dense(tmp_path, case):
    cfg, shards, dtype = CASES[case]
    tensors = write_folder(tmp_path, cfg, shards, dtype)
    model, tokenizer = load_model(tmp_path, kv_cache_dtype="float32")
    assert model.dtype == torch.float32
    assert hf_checkpoint_dtype(tmp_path) == (torch.bfloat16 if "bf16" in case else None)
    assert model.weights.tied == cfg["tie_word_embeddings"]
    ids = tokenizer.encode("the capital of France is Paris, 法国的首都是巴黎. Quick brown foxes!")
    assert len(ids) > 24
    got = all_logits(model, ids).double()
    expected = dense_logits(tensors, cfg, ids)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert (got - expected).abs().max().item() < 1e-4


def test_hf_tokenizer_and_chat_template(tmp_path):
    write_folder(tmp_path, base_config())
    _, tok = load_model(tmp_path)
    text = "法国的首都是巴黎 🇫🇷 def f(x): return x"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": " Hi "}])
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 1
    # eos from tokenizer_config, end of turn from generation_config.json
    assert {tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")} <= (
        tok.stop_token_ids
    )
    # chat_template.jinja (newer HF layout) takes precedence
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    _, tok = load_model(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_hf_folder_in_half_precision(tmp_path):
    write_folder(tmp_path, base_config())
    ref, tok = load_model(tmp_path)
    ids = tok.encode("the capital of France is Paris")
    expected = all_logits(ref, ids)
    for dtype in (torch.bfloat16, torch.float16):
        model, _ = load_model(tmp_path, dtype=dtype)
        assert model.dtype == dtype and model.weights.layers[0].qkv.dtype == dtype
        got = all_logits(model, ids)
        assert got.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
        assert cos.min().item() > 0.99


@pytest.mark.parametrize(
    "tensor, value, dtype",
    [
        ("model.layers.1.mlp.up_proj.weight", float("nan"), torch.float32),
        ("model.norm.weight", float("-inf"), torch.float32),
        ("model.layers.0.self_attn.k_proj.weight", 1e6, torch.float16),  # past fp16's range
    ],
    ids=["NaN", "infinity", "fp16 overflow"],
)
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, tensor, value, dtype):
    """NaN or infinity in a checkpoint, or a value the load dtype cannot hold, is a load
    error naming the tensor and the dtype (not a model that silently samples token 0)."""
    write_folder(tmp_path, base_config())
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors[tensor][3, ...] = value
    save_file(tensors, file)
    with pytest.raises(
        ModelLoadError, match=f"{tensor}'.* holds NaN or infinite values as {dtype}"
    ):
        load_model(tmp_path, dtype=dtype)


def test_the_model_type_is_read_for_the_default_dtype(tmp_path):
    from pagedkern.model.hf_loader import hf_model_type

    write_folder(tmp_path, base_config())
    assert hf_model_type(tmp_path) == base_config()["model_type"]
    assert hf_model_type(tmp_path / "nowhere") is None
