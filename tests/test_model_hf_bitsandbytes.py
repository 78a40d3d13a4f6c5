"""bitsandbytes checkpoints (transformers' load_in_4bit / load_in_8bit saved: the "-bnb-4bit"
releases): tiny transformers models whose linears are stored here as bitsandbytes saves them
(NF4 codes two a byte, a block's absmax double-quantized; LLM.int8()'s int8 rows and SCB),
written from its serialization's description. NF4 weights load as int8 per 32 within 1/254
of each group's largest weight of the values bitsandbytes computes (its table is not an int4
grid), 8-bit ones exactly; the logits follow transformers' on those values."""

from __future__ import annotations

import json

import pytest
import torch
from hf_quantized_files import (
    PROMPT,
    cpu_logits,
    engine_greedy,
    reference_logits,
    tiny_model,
    write_bitsandbytes,
)
from safetensors.torch import load_file, save_file
from transformers_oracle import hf_greedy, relative

from pagedkern.model import ModelLoadError, load_model
from pagedkern.model.hf_loader import hf_checkpoint_quantization
from pagedkern.model.quantized_linear import QuantizedWeight


def _within_int8_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    step = want.abs().view(-1, 32).amax(-1).repeat_interleave(32).view_as(want) / 254
    return bool(((got - want).abs() <= step * 1.0001).all())


@pytest.mark.parametrize("bits,nested", [(4, True), (4, False), (8, False)])
def test_weights_hold_the_checkpoints_values_and_logits_follow(tmp_path, bits, nested):
    hf = tiny_model()
    write_bitsandbytes(tmp_path, hf, bits, nested)
    assert hf_checkpoint_quantization(tmp_path) == "int8"
    model, got = cpu_logits(tmp_path)
    layer, mlp = model.weights.layers[1], hf.model.layers[1].mlp
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(w, QuantizedWeight) and w.format == "int8"
        assert w.group_size == (32 if bits == 4 else 0)
    down = layer.down.dequantize_rows()
    if bits == 8:
        assert torch.equal(down, mlp.down_proj.weight)
    else:
        assert _within_int8_step(down, mlp.down_proj.weight)
    assert torch.equal(model.weights.lm_head, hf.lm_head.weight)  # (skipped: stored plain)
    want = reference_logits(hf)
    assert relative(got, want) < (2e-4 if bits == 8 else 5e-2)  # (int8 per 32 here: ~3%)


def test_the_engine_answers_as_transformers_on_an_8_bit_checkpoint(tmp_path):
    hf = tiny_model("qwen2")
    write_bitsandbytes(tmp_path, hf, 8)
    assert engine_greedy(tmp_path) == hf_greedy(hf, PROMPT, 12)[0]


def test_a_4_bit_weight_without_its_quant_state_parts_is_refused_by_name(tmp_path):
    write_bitsandbytes(tmp_path, tiny_model(), 4)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight.nested_absmax"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj: a uint8 weight.absmax needs its nested"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_a_config_naming_neither_mode_is_refused(tmp_path):
    write_bitsandbytes(tmp_path, tiny_model(), 4)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["load_in_4bit"] = False
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="needs one of load_in_4bit / load_in_8bit"):
        load_model(str(tmp_path), "cpu", torch.float32)
