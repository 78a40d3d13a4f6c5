"""GPTQ and AWQ checkpoints (HF folders with a quantization_config): tiny transformers models
whose linear weights are quantized here, packed the way AutoGPTQ / GPTQModel and AutoAWQ pack
them (written from those formats' descriptions, independently of the loader), must load into
weights equal bit for bit to the dequantized ones, give transformers' logits on the dequantized
model and its greedy tokens through the engine; tensor-parallel ranks get the whole model's
parts; fine-grained FP8 checkpoints load their blocks dequantized; what the loader cannot
represent is refused by name instead of loaded wrong."""

from __future__ import annotations

import json

import pytest
import torch
from hf_model_files import all_logits
from hf_quantized_files import (
    PROMPT,
    SCHEMES,
    assert_layer_holds,
    cpu_logits,
    engine_greedy,
    pack_gptq,
    reference_logits,
    tiny_model,
    write_fp8,
    write_moe_gptq,
    write_quantized,
)
from safetensors.torch import load_file, save_file
from test_tensor_shard_loading import assert_loads_as_cut
from transformers_oracle import hf_greedy, relative

from pagedkern import ops
from pagedkern.model import ModelLoadError, load_model
from pagedkern.model.hf_quantized import Scheme, to_quantized_weight
from pagedkern.model.loading import gemm_weights
from pagedkern.model.quantized_linear import QuantizedWeight
from pagedkern.ops.cpu import quant_gemv

# the CPU backend's tiles for each (csrc/cpu/quant_gemv.h): asymmetric zero points as int4_zp
TILE_FORMATS = {
    "gptq-int4-sym-g128": "int4_sym",
    "gptq-int4-asym-g32": "int4_zp",
    "gptq_v2-int4-asym-g64": "int4_zp",
    "gptq-int4-sym-per-row": "int4_sym",
    "gptq-int8-sym-g128": "int8_g32",
    "awq-int4-g128": "int4_zp",
    "awq-int4-g64": "int4_zp",
}


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def checkpoint(request, tmp_path_factory):
    """(folder, the transformers model holding the dequantized weights, the scheme's name)."""
    hf = tiny_model()
    folder = tmp_path_factory.mktemp(request.param)
    write_quantized(folder, hf, SCHEMES[request.param])
    return folder, hf, request.param


def test_weights_are_the_dequantized_ones_bit_for_bit(checkpoint):
    folder, hf, name = checkpoint
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    layer = model.weights.layers[1]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(w, QuantizedWeight)
        assert w.format == ("int8" if "int8" in name else "int4")
    assert_layer_holds(layer, hf, 1)


def test_logits_equal_transformers_on_the_dequantized_model(checkpoint):
    folder, hf, name = checkpoint
    with ops.use_backend("cpu"):  # the C++ GEMM (the reference backend's torch int-pack GEMM
        # rounds activations to bf16: ~2% off, a different test)
        model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
        got = all_logits(model, PROMPT).double()
    want = reference_logits(hf)
    assert relative(got, want) < 2e-4  # (activations rounded to 16 bits a block of 32)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert quant_gemv.tile_format(model.weights.layers[0].down) == TILE_FORMATS[name]


def test_the_engine_answers_as_transformers(tmp_path):
    hf = tiny_model("qwen2")
    write_quantized(tmp_path, hf, SCHEMES["gptq-int4-asym-g32"])
    assert engine_greedy(tmp_path) == hf_greedy(hf, PROMPT, 12)[0]


def test_quantization_none_dequantizes_int8_requantizes_and_int4_keeps(tmp_path):
    hf = tiny_model()
    write_quantized(tmp_path, hf, SCHEMES["gptq-int4-sym-g128"])
    plain, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="none")
    down = hf.model.layers[0].mlp.down_proj.weight
    assert plain.weights.quantization == "none"
    assert torch.equal(plain.weights.layers[0].down, down)
    int8, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="int8")
    assert int8.weights.layers[0].down.format == "int8"
    same, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="int4")
    kept = same.weights.layers[0].down  # (its own groups of 128, not requantized in 32s)
    assert kept.group_size == 128 and torch.equal(kept.dequantize_rows(), down)


def test_a_mixture_of_experts_keeps_its_experts_quantized(tmp_path):
    folder, reference = write_moe_gptq(tmp_path)
    model, got = cpu_logits(folder)
    experts = model.weights.layers[0].experts_gate_up
    assert isinstance(experts, QuantizedWeight) and experts.shape == (4, 128, 128)
    want = reference_logits(reference)
    assert relative(got, want) < 2e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_own_mode_keeps_a_16_bit_folders_other_tensors_16_bit(tmp_path):
    """--quantization int4 on an int4 folder is the folder as it is: its bf16 embedding and
    head stay bf16 under fp32 activations, as without the flag."""
    write_quantized(tmp_path, tiny_model(), SCHEMES["awq-int4-g128"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    half = {n: t.bfloat16() if t.is_floating_point() and t.dtype != torch.float16 else t
            for n, t in tensors.items()}  # fmt: skip
    save_file(half, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    default, _ = load_model(str(tmp_path), "cpu", torch.float32)
    own, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="int4")
    assert default.weights.lm_head.dtype == own.weights.lm_head.dtype == torch.bfloat16
    plain, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="none")
    assert plain.weights.lm_head.dtype == torch.bfloat16  # (the 16-bit rule of plain folders)


@pytest.mark.parametrize(
    "file,method,fields",
    [
        ("quantize_config.json", "gptq", {"bits": 4, "group_size": 32, "sym": False}),
        ("quant_config.json", "awq", {"w_bit": 4, "q_group_size": 128, "zero_point": True}),
    ],
)
def test_an_older_exports_own_quantize_config_file_is_read(tmp_path, file, method, fields):
    scheme = "gptq-int4-asym-g32" if method == "gptq" else "awq-int4-g128"
    hf = tiny_model()
    write_quantized(tmp_path, hf, SCHEMES[scheme])
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / file).write_text(json.dumps(fields))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    assert isinstance(model.weights.layers[0].down, QuantizedWeight)
    want = hf.model.layers[0].mlp.down_proj.weight
    assert torch.equal(model.weights.layers[0].down.dequantize_rows(), want)


def test_gptqmodels_format_key_names_the_zero_points_convention(tmp_path):
    hf = tiny_model()
    write_quantized(tmp_path, hf, SCHEMES["gptq_v2-int4-asym-g64"])
    config = json.loads((tmp_path / "config.json").read_text())
    qc = config["quantization_config"]
    qc["format"] = qc.pop("checkpoint_format")  # ("gptq_v2" under the other key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    want = hf.model.layers[0].mlp.down_proj.weight
    assert torch.equal(model.weights.layers[0].down.dequantize_rows(), want)
    _with_config(tmp_path, checkpoint_format="gptq")
    with pytest.raises(ModelLoadError, match="checkpoint_format and format differ"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_in_features_that_no_tile_takes_are_refused_at_load():
    codes = torch.randint(0, 256, (200, 16), dtype=torch.int32)  # K = 200, per row
    qweight, qzeros = pack_gptq(codes, torch.full((1, 16), 128, dtype=torch.int32), 8, False)
    scheme = Scheme("gptq", 8, -1, False)
    with pytest.raises(ValueError, match="200 input channels: not a multiple of 32"):
        to_quantized_weight(scheme, qweight, qzeros, torch.ones(1, 16, dtype=torch.float16))


def test_a_folder_whose_first_layer_is_float_is_still_seen_as_quantized(tmp_path):
    """GPTQModel's dynamic skips and AWQ's modules_to_not_convert can leave layer 0 float:
    `none` and a GPU's GEMM weights must still dequantize the other layers."""
    hf = tiny_model()
    write_quantized(tmp_path, hf, SCHEMES["gptq-int4-sym-g128"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.0.") and "qweight" in n]:
        stem = name.removesuffix("qweight")
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[stem + part]
        tensors[stem + "weight"] = hf.get_parameter(stem + "weight").detach().contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    layers = model.weights.layers
    assert not isinstance(layers[0].down, QuantizedWeight)
    assert isinstance(layers[1].down, QuantizedWeight)
    plain, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="none")
    assert not isinstance(plain.weights.layers[1].down, QuantizedWeight)
    on_a_gpu = gemm_weights(model.weights, torch.device("cuda"), torch.float32)
    assert not isinstance(on_a_gpu.layers[1].down, QuantizedWeight)  # (dequantized, as all)
    assert torch.equal(on_a_gpu.layers[1].down, hf.model.layers[1].mlp.down_proj.weight)


def test_a_quantized_lm_head_loads_too(tmp_path):
    hf = tiny_model()
    write_quantized(tmp_path, hf, SCHEMES["awq-int4-g128"], lm_head=True)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    assert isinstance(model.weights.lm_head, QuantizedWeight)
    assert torch.equal(model.weights.lm_head.dequantize_rows(), hf.lm_head.weight)


def test_tensor_parallel_ranks_load_the_whole_models_parts(tmp_path):
    write_quantized(tmp_path, tiny_model(), SCHEMES["gptq-int4-asym-g32"])
    assert_loads_as_cut(str(tmp_path), 2)  # (O's 128 columns: 64 a rank, whole groups of 32)


def _with_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"quant_method": "compressed-tensors"}, "compressed-tensors needs config_groups"),
        ({"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
        ({"bits": 3}, "gptq with bits 3 is not supported"),
        ({"bits": "4"}, "bits must be an integer"),
        ({"group_size": 48}, "group_size 48 is not supported"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ],
)
def test_what_cannot_be_represented_is_refused_by_name(tmp_path, changes, message):
    write_quantized(tmp_path, tiny_model(), SCHEMES["gptq-int4-sym-g128"])
    _with_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_an_fp8_checkpoint_loads_its_blocks_dequantized(tmp_path):
    hf = tiny_model()
    write_fp8(tmp_path, hf, [48, 64])  # (partial blocks at the edges of every weight)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, kv_cache_dtype="float32")
    mlp = hf.model.layers[1].mlp
    assert torch.equal(model.weights.layers[1].down, mlp.down_proj.weight)
    got = all_logits(model, PROMPT).double()
    want = reference_logits(hf)
    assert relative(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert_loads_as_cut(str(tmp_path), 2)


def test_fp8_weights_without_their_scales_are_refused_not_read_as_plain_floats(tmp_path):
    write_fp8(tmp_path, tiny_model(), [64, 64], config=False)  # (no quantization_config)
    with pytest.raises(ModelLoadError, match="is torch.float8_e4m3fn, with no scale to apply"):
        load_model(str(tmp_path), "cpu", torch.float32)
    write_fp8(tmp_path, tiny_model(), [64, 64])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj.weight' is torch.float8_e4m3fn, with no"):
        load_model(str(tmp_path), "cpu", torch.float32)
    _with_config(tmp_path, weight_block_size=[128])
    with pytest.raises(ModelLoadError, match="fp8 needs weight_block_size"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_uneven_groups_and_asymmetric_int8_are_refused_by_name(tmp_path):
    write_quantized(tmp_path, tiny_model(), SCHEMES["gptq-int4-sym-g128"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = torch.zeros_like(tensors[name])  # (every channel in group 0 of 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"down_proj: g_idx does not give each of the 2"):
        load_model(str(tmp_path), "cpu", torch.float32)

    write_quantized(tmp_path, tiny_model(), dict(SCHEMES["gptq-int8-sym-g128"], sym=False))
    with pytest.raises(ModelLoadError, match="asymmetric 8-bit weights"):
        load_model(str(tmp_path), "cpu", torch.float32)
