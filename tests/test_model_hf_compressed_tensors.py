"""compressed-tensors checkpoints (llm-compressor's W4A16, W8A16, W8A8 and FP8 releases): tiny
transformers models whose linears are quantized and packed here as compressed-tensors stores
them (its dense int32 packing checked against the library's own packer when this was written),
must load into the dequantized weights bit for bit, give transformers' logits on them and its
greedy tokens through the engine; act-order groups, tensor-parallel ranks and the folder's own
mode work as for GPTQ; mixture-of-experts folders (Qwen3-MoE, Mixtral: experts quantized, the
routers ignored) keep their experts quantized, as GPTQ's do; what the loader cannot represent is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from hf_quantized_files import (
    COMPRESSED_TENSORS,
    PROMPT,
    assert_layer_holds,
    cpu_logits,
    engine_greedy,
    pack_rows,
    reference_logits,
    shared_orders,
    tiny_model,
    write_compressed_tensors,
    write_moe_compressed_tensors,
)
from test_expert_parallel_loading import assert_loads_as_cut as assert_experts_load_as_cut
from test_tensor_shard_loading import assert_loads_as_cut
from transformers_oracle import hf_greedy, relative

from pagedkern.model import ModelLoadError, load_model
from pagedkern.model.hf_compressed_tensors import unpack_weight
from pagedkern.model.hf_loader import hf_checkpoint_quantization
from pagedkern.model.quantized_linear import QuantizedWeight
from pagedkern.ops.cpu import quant_gemv

# the form each loads in: (QuantizedWeight format, group size) or "float" (fp8: dequantized)
FORMS = {
    "w4a16-sym-g128": ("int4", 128),
    "w4a16-asym-g32": ("int4", 32),
    "w4a16-sym-channel": ("int4", 128),
    "w8a16-sym-g32": ("int8", 32),
    "w8a16-sym-channel": ("int8", 0),
    "w8a8-int-channel": ("int8", 0),
    "fp8-channel": "float",
    "fp8-block": "float",
}
TILES = {"w4a16-sym-g128": "int4_sym", "w4a16-asym-g32": "int4_zp", "w8a16-sym-g32": "int8_g32"}


@pytest.fixture(scope="module", params=sorted(COMPRESSED_TENSORS))
def checkpoint(request, tmp_path_factory):
    hf = tiny_model()
    folder = tmp_path_factory.mktemp(request.param)
    write_compressed_tensors(folder, hf, request.param)
    return folder, hf, request.param


def test_weights_are_the_dequantized_ones_bit_for_bit(checkpoint):
    folder, hf, name = checkpoint
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    layer = model.weights.layers[1]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
        if FORMS[name] == "float":
            assert isinstance(w, torch.Tensor)
        else:
            assert isinstance(w, QuantizedWeight) and (w.format, w.group_size) == FORMS[name]
    assert_layer_holds(layer, hf, 1)
    assert torch.equal(model.weights.lm_head, hf.lm_head.weight)  # (ignored: stored plain)


def test_logits_equal_transformers_on_the_dequantized_model(checkpoint):
    folder, hf, name = checkpoint
    model, got = cpu_logits(folder)
    want = reference_logits(hf)
    assert relative(got, want) < 2e-4  # (activations rounded to 16 bits a block of 32)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if name in TILES:
        assert quant_gemv.tile_format(model.weights.layers[0].down) == TILES[name]


def test_the_folders_own_mode_is_read_from_its_config_groups(checkpoint):
    folder, _, name = checkpoint
    form = FORMS[name]
    assert hf_checkpoint_quantization(folder) == (None if form == "float" else form[0])


def test_the_engine_answers_as_transformers(tmp_path):
    hf = tiny_model("qwen2")
    write_compressed_tensors(tmp_path, hf, "w4a16-sym-g128")
    assert engine_greedy(tmp_path) == hf_greedy(hf, PROMPT, 12)[0]


def test_act_order_groups_load_in_their_order(tmp_path):
    hf = tiny_model()
    write_compressed_tensors(tmp_path, hf, "w4a16-asym-g32", orders=shared_orders(11))
    model, got = cpu_logits(tmp_path)
    down = model.weights.layers[0].down
    assert down.input_index is not None
    assert torch.equal(down.dequantize_rows(), hf.model.layers[0].mlp.down_proj.weight)
    want = reference_logits(hf)
    assert relative(got, want) < 2e-4


def test_tensor_parallel_ranks_load_the_whole_models_parts(tmp_path):
    write_compressed_tensors(tmp_path, tiny_model(), "w4a16-asym-g32")
    assert_loads_as_cut(str(tmp_path), 2)


def _with_config(folder, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config["quantization_config"])
    path.write_text(json.dumps(config))


def _weights(qc):
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparse format"),
        (lambda qc: qc["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
         "format 'nvfp4-pack-quantized' is not supported"),
        (lambda qc: _weights(qc).update(num_bits=3), "int weights of 3 bits"),
        (lambda qc: _weights(qc).update(type="mx"), "weights type 'mx'"),
        (lambda qc: _weights(qc).update(strategy="tensor_group"), "strategy 'tensor_group'"),
        (lambda qc: qc.pop("config_groups"), "compressed-tensors needs config_groups"),
        (lambda qc: qc.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
         "transform_config"),
        (lambda qc: qc["config_groups"]["group_0"].update(weights=[4]), "weights must be a JSON"),
    ],
)  # fmt: skip
def test_what_cannot_be_represented_is_refused_by_name(tmp_path, change, message):
    write_compressed_tensors(tmp_path, tiny_model(), "w4a16-sym-g128")
    _with_config(tmp_path, change)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_a_misshapen_part_is_refused_naming_the_linear(tmp_path):
    from safetensors.torch import load_file, save_file

    write_compressed_tensors(tmp_path, tiny_model(), "w4a16-sym-g128")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight_packed"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj: weight_packed \(256, 15\) packs no"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_groups_other_than_the_configs_are_refused(tmp_path):
    """A weight's groups are read off its scales' shape: K / columns. compressed-tensors makes
    ceil(K / group_size) of them, so where group_size does not divide K (K = 192 in groups of
    128: 2 columns) that quotient is not the group size, and the weight would load wrong: a
    weight whose groups are not of the config's group_size is refused. Shown with a g32 folder
    whose config says 64, and directly with a K of 192."""
    write_compressed_tensors(tmp_path, tiny_model(), "w4a16-asym-g32")
    _with_config(tmp_path, lambda qc: _weights(qc).update(group_size=64))
    with pytest.raises(ModelLoadError, match=r"in \d+ groups of the config's group_size 64"):
        load_model(str(tmp_path), "cpu", torch.float32)
    n, k = 8, 192
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0))
    scale = torch.full((n, 2), 0.01).bfloat16()
    with pytest.raises(ValueError, match="a last group shorter than the others"):
        unpack_weight(pack_rows(codes, 4), scale, torch.tensor([n, k]), group_sizes=(128,))
    even = unpack_weight(pack_rows(codes, 4), scale, torch.tensor([n, k]), group_sizes=(96,))
    assert torch.equal(even.dequantize_rows(), (codes - 8).float() * scale.float()[:, :1])


@pytest.mark.parametrize("groups", [1, 2])  # a scale a row (W8A8-like), groups of 32
def test_int8_codes_of_minus_128_are_requantized_within_int8s_step(groups):
    """compressed-tensors' int8 range is -128..127 (scale absmax / 127.5), and the CPU kernels
    negate codes with a sign trick that -128 defeats: such a weight is requantized from its
    exact values (the rest stay as stored), and its GEMM is right."""
    g = torch.Generator().manual_seed(groups)
    n, k = 16, 64
    stored = torch.randint(1, 256, (n, k), generator=g)
    stored[3, 7] = 0  # (code -128)
    scale = (torch.rand(n, groups, generator=g) * 0.01 + 1e-3).bfloat16()
    qw = unpack_weight(pack_rows(stored, 8), scale, torch.tensor([n, k]))
    want = (stored - 128).float() * scale.float().repeat_interleave(k // groups, dim=1)
    assert qw.format == "int8" and int(qw.qweight.min()) >= -127
    width = k if groups == 1 else 32
    step = want.abs().view(n, -1, width).amax(-1).repeat_interleave(width, dim=1) / 254
    assert ((qw.dequantize_rows() - want).abs() <= step * 1.0001).all()
    plain = unpack_weight(pack_rows(stored.clamp(min=1), 8), scale, torch.tensor([n, k]))
    assert torch.equal(plain.qweight, (stored.clamp(min=1) - 128).to(torch.int8))  # (exact)
    if quant_gemv.available():
        x = torch.randn(3, k, generator=g)
        got = quant_gemv.quant_gemv(x, qw).double()
        exact = x.double() @ qw.dequantize_rows().double().T
        assert (got - exact).abs().max() <= 1e-4 * (x.abs() @ want.abs().T).max()


# MoE folders as llm-compressor's MoE examples quantize them (W4A16 in groups of 128 with a
# moe_intermediate_size they divide, in groups of 32 asymmetric; W8A16 a scale a row), each
# (scheme, architecture, the experts' form, moe_intermediate_size)
MOE = {
    "w4a16-sym-g128": ("w4a16-sym-g128", "qwen3_moe", ("int4", 128), 256),
    "w4a16-asym-g32": ("w4a16-asym-g32", "qwen3_moe", ("int4", 32), 64),
    "w8a16-sym-channel": ("w8a16-sym-channel", "qwen3_moe", ("int8", 0), 64),
    "mixtral-w4a16-asym-g32": ("w4a16-asym-g32", "mixtral", ("int4", 32), 64),
}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_checkpoint(request, tmp_path_factory):
    """(folder, the transformers MoE holding the dequantized weights, the case's name)."""
    scheme, arch, _, moe_i = MOE[request.param]
    tmp = tmp_path_factory.mktemp("moe-" + request.param)
    folder, reference = write_moe_compressed_tensors(tmp, scheme, None, moe_i, arch)
    return folder, reference, request.param


def test_moe_experts_stay_quantized_as_the_dequantized_ones_bit_for_bit(moe_checkpoint):
    """Every expert's gate/up and down stacked quantized in the scheme's form, equal to the
    reference's experts bit for bit; the ignored router stored float and loaded as it is."""
    folder, reference, name = moe_checkpoint
    _, _, form, moe_i = MOE[name]
    assert hf_checkpoint_quantization(folder) == form[0]
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    for n, layer in enumerate(model.weights.layers):
        mlp, attn = reference.model.layers[n].mlp, reference.model.layers[n].self_attn
        gate_up, down = layer.experts_gate_up, layer.experts_down
        for w, shape in ((gate_up, (4, 2 * moe_i, 128)), (down, (4, 128, moe_i))):
            assert isinstance(w, QuantizedWeight) and (w.format, w.group_size) == form
            assert tuple(w.shape) == shape
        for e in range(4):  # (transformers' experts: gate_up_proj [E, 2I, H], gate rows first)
            assert torch.equal(gate_up.expert(e).dequantize_rows(), mlp.experts.gate_up_proj[e])
            assert torch.equal(down.expert(e).dequantize_rows(), mlp.experts.down_proj[e])
        assert torch.equal(layer.router, mlp.gate.weight)  # (ignored: float as stored)
        want_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert torch.equal(layer.qkv.dequantize_rows(), want_qkv)
        assert torch.equal(layer.o.dequantize_rows(), attn.o_proj.weight)
        assert layer.gate_up is None and layer.down is None  # (no shared expert)
    assert torch.equal(model.weights.lm_head, reference.lm_head.weight)


def test_moe_logits_equal_transformers_on_the_dequantized_model(moe_checkpoint):
    folder, reference, _ = moe_checkpoint
    model, got = cpu_logits(folder)
    want = reference_logits(reference)
    assert relative(got, want) < 2e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_moe_the_engine_answers_as_transformers(moe_checkpoint):
    folder, reference, _ = moe_checkpoint
    assert engine_greedy(folder) == hf_greedy(reference, PROMPT, 12)[0]


def own_orders():
    """orders(name, K): each linear its own random input order (each expert saw tokens of its
    own)."""
    counter = iter(range(1000))
    return lambda name, k: torch.randperm(k, generator=torch.Generator().manual_seed(next(counter)))


def test_moe_act_order_experts_load_as_int8_per_32(tmp_path):
    """Experts with act-order groups (weight_g_idx), each its own order: no MoE kernel gathers
    by one, so they are requantized to int8 per 32 (within 1/254 of a group's largest weight);
    the attention keeps its order and its codes."""
    folder, reference = write_moe_compressed_tensors(tmp_path, "w4a16-asym-g32", own_orders())
    model, got = cpu_logits(folder)
    layer = model.weights.layers[0]
    assert layer.experts_gate_up.kind == layer.experts_down.kind == ("int8", 32, False)
    assert layer.o.format == "int4" and layer.o.input_index is not None
    assert torch.equal(layer.o.dequantize_rows(), reference.model.layers[0].self_attn.o_proj.weight)
    mlp = reference.model.layers[0].mlp
    for got_w, want_w in (
        (layer.experts_down.expert(1), mlp.experts.down_proj[1]),
        (layer.experts_gate_up.expert(2), mlp.experts.gate_up_proj[2]),
    ):
        step = want_w.abs().view(-1, 32).amax(-1).repeat_interleave(32).view_as(want_w) / 254
        assert ((got_w.dequantize_rows() - want_w).abs() <= step * 1.0001).all()
    want = reference_logits(reference)
    assert relative(got, want) < 5e-2


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("split", ["tensor", "expert"])
def test_moe_ranks_load_the_whole_models_parts(tmp_path, monkeypatch, split, act_order):
    """Tensor-parallel ranks (each expert's rows / columns) and expert-parallel ranks (whole
    experts) of a compressed-tensors MoE equal the whole model cut for them."""
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))
    orders = own_orders() if act_order else None
    folder, _ = write_moe_compressed_tensors(tmp_path, "w4a16-asym-g32", orders)
    (assert_loads_as_cut if split == "tensor" else assert_experts_load_as_cut)(str(folder), 2)
