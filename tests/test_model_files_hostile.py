"""Hostile or broken model files: metadata and config values of the wrong type or out of range,
counts past the checkpoint's tensors, contexts too long to build a RoPE table for, index files
naming files outside the folder, tokenizer files of the wrong shape and chat templates that ask
for unbounded work. Each is refused with a ModelLoadError naming the file and the key (or, for a
template, a jinja2 TemplateError at render time), never a crash, a raw error from deep inside a
reader or a runaway allocation."""

from __future__ import annotations

import json
import math
import shutil

import gguf
import jinja2
import pytest
import torch
from gguf import GGUFValueType as V
from hf_model_files import add_gguf_tokenizer, base_config, finish_gguf, hf_tensors, write_folder

from pagedkern.model import (
    ModelConfig,
    ModelLoadError,
    RopeScaling,
    Tokenizer,
    load_model,
    read_gguf_tokenizer,
)
from pagedkern.model.chat_template import render_chat
from pagedkern.model.gguf_names import gguf_name


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


# --- GGUF --------------------------------------------------------------------------------------


def write_gguf(path, meta=None, shapes=None):
    """A one-layer F32 llama GGUF with the test tokenizer; meta: key -> (value, type[, sub_type])
    set over what the writer wrote; shapes: tensor -> the dims its header claims (GGUF order)."""
    w = gguf.GGUFWriter(str(path), "llama")
    cfg = base_config(num_hidden_layers=1, vocab_size=len(add_gguf_tokenizer(w)))
    w.add_block_count(1)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    for name, t in hf_tensors(cfg, 0).items():
        w.add_tensor(gguf_name(name), t.numpy())
    for key, (value, kind, *sub) in (meta or {}).items():
        w.kv_data[0][key] = gguf.GGUFValue(value, kind, sub[0] if sub else None)
    for name, dims in (shapes or {}).items():
        info = w.tensors[0][name]
        w.tensors[0][name] = type(info)(dims, info.dtype, info.nbytes, info.tensor)
    finish_gguf(w)
    return path


def gguf_problem(tmp_path, **kwargs) -> str:
    path = write_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, use_cache=False)
    assert info.value.source == str(path)
    return info.value.problem


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("llama.block_count", 1.5, V.FLOAT32),  # (was truncated to 1)
        ("llama.attention.head_count", "four", V.STRING),
        ("llama.attention.head_count_kv", [2], V.ARRAY),  # (per-layer counts)
        ("llama.context_length", [256], V.ARRAY),
        ("llama.rope.freq_base", "big", V.STRING),
    ],
)
def test_gguf_metadata_of_the_wrong_type_names_the_key(tmp_path, key, value, kind):
    sub = (V.UINT32,) if kind == V.ARRAY else ()
    problem = gguf_problem(tmp_path, meta={key: (value, kind, *sub)})
    assert key in problem and repr(value) in problem


@pytest.mark.parametrize(
    "key, value, kind, words",
    [
        ("llama.attention.head_count", 0, V.UINT32, "head_count"),  # (was a ZeroDivisionError)
        ("llama.context_length", 0, V.UINT32, "context_length"),  # (loaded: an empty RoPE table)
        ("llama.context_length", 2**40, V.UINT64, "max_position_embeddings"),  # (8 TB table)
        ("llama.rope.freq_base", 0.0, V.FLOAT32, "rope_theta"),
        ("llama.rope.freq_base", math.nan, V.FLOAT32, "freq_base"),
        ("llama.attention.layer_norm_rms_epsilon", math.nan, V.FLOAT32, "epsilon"),
        ("llama.attention.value_length", 8, V.UINT32, "value heads"),
    ],
)
def test_gguf_metadata_out_of_range_is_refused(tmp_path, key, value, kind, words):
    assert words in gguf_problem(tmp_path, meta={key: (value, kind)})


def test_gguf_rope_scaling_factor_must_be_positive(tmp_path):
    meta = {"llama.rope.scaling.type": ("linear", V.STRING)}
    meta["llama.rope.scaling.factor"] = (0.0, V.FLOAT32)
    assert "factor" in gguf_problem(tmp_path, meta=meta)


def test_gguf_block_count_past_the_tensors_is_refused_before_listing_them(tmp_path):
    problem = gguf_problem(tmp_path, meta={"llama.block_count": (10**5, V.UINT32)})
    assert "block_count is 100000" in problem and "layer 99999" in problem


def test_gguf_embedding_of_one_dimension(tmp_path):
    shapes = {"token_embd.weight": (64 * 320,)}  # (was an IndexError reading its rows)
    assert "token_embd.weight" in gguf_problem(tmp_path, shapes=shapes)


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("tokenizer.ggml.token_type", [1, 3], V.ARRAY),  # (fewer than the tokens)
        ("tokenizer.ggml.merges", [1, 2], V.ARRAY),
        ("tokenizer.ggml.eos_token_id", "x", V.STRING),
        ("tokenizer.chat_template", 5, V.UINT32),
    ],
)
def test_gguf_tokenizer_metadata_of_the_wrong_shape_names_the_key(tmp_path, key, value, kind):
    sub = (V.INT32,) if kind == V.ARRAY else ()
    path = write_gguf(tmp_path / "m.gguf", meta={key: (value, kind, *sub)})
    with pytest.raises(ModelLoadError, match=key.rsplit(".", 1)[-1]) as info:
        read_gguf_tokenizer(path)
    assert info.value.source == str(path)


def test_gguf_stop_ids_past_the_vocabulary_are_dropped(tmp_path):
    """As llama.cpp ignores a bad special token id (llguidance refuses a stop set naming one)."""
    meta = {"tokenizer.ggml.eot_token_id": (10**9, V.UINT32)}
    tok = read_gguf_tokenizer(write_gguf(tmp_path / "m.gguf", meta=meta))
    assert tok.stop_token_ids and max(tok.stop_token_ids) < tok.vocab_size


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# --- HF folders --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "base"
    folder.mkdir()
    write_folder(folder, base_config(num_hidden_layers=1))
    return folder


def hf_folder(base_folder, tmp_path, **changes):
    """The base folder with config.json's keys changed (None: removed)."""
    folder = shutil.copytree(base_folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_problem(base_folder, tmp_path, **changes) -> ModelLoadError:
    folder = hf_folder(base_folder, tmp_path, **changes)
    with pytest.raises(ModelLoadError) as info:
        load_model(folder)
    return info.value


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_hidden_layers", 1.5),  # (was truncated to 1)
        ("num_hidden_layers", True),  # (was 1 layer)
        ("num_hidden_layers", "1"),
        ("tie_word_embeddings", "false"),  # (bool("false") is True)
        ("model_type", ["llama"]),
        ("architectures", 5),
        ("rope_scaling", [1, 2]),
        ("rope_parameters", "linear"),
    ],
)
def test_hf_config_values_of_the_wrong_type_name_the_key(base_folder, tmp_path, key, value):
    error = hf_problem(base_folder, tmp_path, **{key: value})
    assert error.source.endswith("config.json")
    assert key in error.problem and repr(value) in error.problem


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),  # (was a ZeroDivisionError)
        ({"head_dim": 0}, "head_dim"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),  # (loaded)
        ({"max_position_embeddings": -1}, "max_position_embeddings"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": math.nan}, "rope_theta"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 4.0,  # (a division by zero in the smoothing)
                    "original_max_position_embeddings": 128,
                }
            },
            "high_freq_factor",
        ),
        (
            {"rope_scaling": YARN, "rope_theta": 1.0},
            "rope_theta",  # (YaRN divides by its log)
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 0,  # (a math domain error)
                }
            },
            "original_max_position_embeddings",
        ),
    ],
)
def test_hf_config_values_out_of_range_are_refused(base_folder, tmp_path, changes, words):
    error = hf_problem(base_folder, tmp_path, **changes)
    assert error.source.endswith("config.json") and words in error.problem


def test_hf_layers_past_the_checkpoint_are_refused_before_listing_them(base_folder, tmp_path):
    error = hf_problem(base_folder, tmp_path, num_hidden_layers=10**5)
    assert "num_hidden_layers is 100000" in error.problem and "layer 99999" in error.problem


def test_hf_experts_past_the_checkpoint_are_refused_before_listing_them(base_folder, tmp_path):
    changes = dict(model_type="mixtral", architectures=["MixtralForCausalLM"])
    error = hf_problem(base_folder, tmp_path, num_local_experts=10**5, **changes)
    assert "expert 99999" in error.problem


def test_hf_torch_dtype_of_the_wrong_type_is_ignored(base_folder, tmp_path):
    """torch_dtype only picks the default dtype: anything but a half type's name is none."""
    model, _ = load_model(hf_folder(base_folder, tmp_path, torch_dtype=["float16"]))
    assert model.dtype == torch.float32


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"x": 5}])
def test_hf_index_of_the_wrong_shape(base_folder, tmp_path, weight_map):
    folder = hf_folder(base_folder, tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="weight_map") as info:
        load_model(folder)
    assert info.value.source == str(index)


def test_hf_index_may_not_name_files_outside_the_folder(base_folder, tmp_path):
    folder = hf_folder(base_folder, tmp_path)
    (folder / "model.safetensors").rename(tmp_path / "outside.safetensors")
    weight_map = dict.fromkeys(
        hf_tensors(base_config(num_hidden_layers=1), 0), "../outside.safetensors"
    )
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="outside"):
        load_model(folder)


# --- tokenizer files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "file, content, words",
    [
        ("tokenizer_config.json", [1], "JSON object"),
        ("tokenizer_config.json", {"chat_template": 5}, "chat_template"),
        ("tokenizer_config.json", {"chat_template": ["a template"]}, "chat_template"),
        ("tokenizer_config.json", {"eos_token": 5}, "eos_token"),
        ("tokenizer_config.json", {"pagedkern_stop_token_ids": "ab"}, "pagedkern_stop_token_ids"),
        ("generation_config.json", [1], "JSON object"),
        ("generation_config.json", {"eos_token_id": "x"}, "eos_token_id"),
        ("generation_config.json", {"eos_token_id": 1.5}, "eos_token_id"),
        ("generation_config.json", {"eos_token_id": {"a": 1}}, "eos_token_id"),
    ],
)
def test_tokenizer_files_of_the_wrong_shape_name_the_file(
    base_folder, tmp_path, file, content, words
):
    folder = shutil.copytree(base_folder, tmp_path / "m")
    (folder / file).write_text(json.dumps(content))
    with pytest.raises(ModelLoadError, match=words) as info:
        Tokenizer.from_folder(folder)
    assert info.value.source == str(folder / file)


def test_a_chat_template_file_not_in_utf8(base_folder, tmp_path):
    folder = shutil.copytree(base_folder, tmp_path / "m")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ModelLoadError, match="UTF-8") as info:
        Tokenizer.from_folder(folder)
    assert info.value.source == str(folder / "chat_template.jinja")


def test_generation_config_ids_past_the_vocabulary_are_dropped(base_folder, tmp_path):
    folder = shutil.copytree(base_folder, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**9, -1]}))
    tok = Tokenizer.from_folder(folder)
    assert tok.stop_token_ids and all(0 <= i < tok.vocab_size for i in tok.stop_token_ids)


# --- chat templates ----------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 100000000000 }}",  # (was a MemoryError)
        "{% for i in range(2000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
        "{% if 2 ** 10000000 > 1 %}big{% endif %}",
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",  # (was a RecursionError)
        "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}",
    ],
)
def test_a_chat_template_asking_for_unbounded_work_is_a_template_error(template):
    with pytest.raises(jinja2.TemplateError):
        render_chat(template, HI)


def test_bounded_template_work_still_renders():
    template = "{{ '-' * 80 }}{% for i in range(1000) %}{{ i % 10 }}{% endfor %}{{ 2 ** 64 }}"
    assert render_chat(template, HI) == "-" * 80 + "0123456789" * 100 + str(2**64)


# --- ModelConfig -------------------------------------------------------------------------------


def test_model_config_errors_name_the_field_and_value():
    tiny = dict(
        name="t", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_layers must be positive, got 0"):
        ModelConfig(**{**tiny, "num_layers": 0})
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig(**tiny, rope_theta=-1.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelConfig(**tiny, max_position_embeddings=2**40)
    with pytest.raises(ValueError, match="factor"):
        RopeScaling("linear", math.inf)
