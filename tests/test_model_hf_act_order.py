"""GPTQ act-order (desc_act) checkpoints: each linear's input channels were quantized in an
order of their own, so a group's channels lie anywhere along K and g_idx says which group each
belongs to. The loader sorts the channels by group and keeps the weight quantized with that
order as its input_index (the GEMMs gather x by it). Tiny transformers models are quantized
here in random orders, packed as AutoGPTQ packs them, and must load into the dequantized
weights bit for bit, give transformers' logits on them (every CPU GEMM path, and the CUDA
kernel's in the emulator), its greedy tokens through the engine, and load under tensor
parallelism and with experts."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from hf_model_files import all_logits
from hf_quantized_files import (
    PROMPT,
    SCHEMES,
    assert_layer_holds,
    cpu_logits,
    engine_greedy,
    reference_logits,
    shared_orders,
    tiny_model,
    write_moe_gptq,
    write_quantized,
)
from transformers_oracle import hf_greedy, relative

import pagedkern.ops.quant_gemm  # noqa: F401  (imported before emulated() patches the op modules)
from pagedkern import ops
from pagedkern.model import load_model
from pagedkern.model.loading import gemm_weights
from pagedkern.model.quantized_linear import QuantizedWeight, quantize_int4, quantize_int8
from pagedkern.model.weight_shards import shard_weights
from pagedkern.ops import variants
from pagedkern.reference.quant_gemm import quant_linear as reference_linear

pytest.importorskip("transformers")


ACT_ORDER_SCHEMES = ("gptq-int4-sym-g128", "gptq-int4-asym-g32", "gptq-int8-sym-g128")


@pytest.fixture(scope="module", params=ACT_ORDER_SCHEMES)
def checkpoint(request, tmp_path_factory):
    hf = tiny_model()
    folder = tmp_path_factory.mktemp(request.param + "-act-order")
    write_quantized(folder, hf, SCHEMES[request.param], orders=shared_orders())
    return folder, hf, request.param


def test_act_order_weights_stay_quantized_and_dequantize_bit_for_bit(checkpoint):
    folder, hf, name = checkpoint
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    layer = model.weights.layers[1]
    group = SCHEMES[name]["group_size"]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(w, QuantizedWeight)
        assert (w.input_index is not None) == (w.shape[1] > group)  # (one group: no order)
        assert w.format == ("int8" if "int8" in name else "int4")
    assert_layer_holds(layer, hf, 1)
    # (a CUDA model's GEMM weights: dequantized, the columns in the input's order)
    on_a_gpu = gemm_weights(model.weights, torch.device("cuda"), torch.float32)
    assert_layer_holds(on_a_gpu.layers[1], hf, 1)


@pytest.mark.parametrize("variant", ["int16_activations", "int8_activations", "int_pack"])
def test_act_order_logits_equal_transformers(checkpoint, variant):
    folder, hf, _ = checkpoint
    with ops.use_backend("cpu"), variants.use_kernels(cpu_quant_linear=variant):
        model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
        got = all_logits(model, PROMPT).double()
    want = reference_logits(hf)
    # (16-bit activations: 2e-4; llama.cpp's int8 ones and torch's bf16 ones: 1-3% on this
    # model's large random weights; inputs not gathered: ~100%)
    assert relative(got, want) < (2e-4 if variant == "int16_activations" else 6e-2)
    if variant == "int16_activations":
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_one_call_decoder_gathers_as_the_layer_loop_does(checkpoint, kernels, decoder_runs):
    """csrc/cpu/'s decoder gathers each act-order GEMV's input itself: the same bits as the
    layer loop's GEMMs (quant_gemv gathering in Python), in one call a step."""
    folder, _, _ = checkpoint
    model, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    runs = {}
    for variant in ("layers", "fused"):
        kernels(cpu_decoder=variant)
        with ops.use_backend("cpu"):
            runs[variant] = all_logits(model, PROMPT)
    assert decoder_runs == [len(PROMPT)]  # (the decoder ran, once; the loop did not call it)
    assert not runs["fused"].isnan().any()
    assert torch.equal(runs["fused"], runs["layers"])


def test_the_engine_answers_as_transformers_on_an_act_order_checkpoint(tmp_path):
    hf = tiny_model("qwen2")
    write_quantized(tmp_path, hf, SCHEMES["gptq-int4-asym-g32"], orders=shared_orders(7))
    assert engine_greedy(tmp_path) == hf_greedy(hf, PROMPT, 12)[0]


def test_qkv_in_orders_of_their_own_fuse_within_int8s_step(tmp_path):
    """Q, K and V quantized in different orders (not what GPTQ writes) cannot share one
    gather: fused requantized to int8 per 32 (as a GGUF's mixed Q4_K / Q6_K parts are)."""
    hf = tiny_model()
    counter = iter(range(1000))

    def own_orders(name: str, k: int) -> torch.Tensor:
        return torch.randperm(k, generator=torch.Generator().manual_seed(next(counter)))

    write_quantized(tmp_path, hf, SCHEMES["gptq-int4-asym-g32"], orders=own_orders)
    model, got = cpu_logits(tmp_path)
    layer = model.weights.layers[0]
    assert layer.qkv.format == "int8" and layer.qkv.input_index is None
    assert layer.down.format == "int4" and layer.down.input_index is not None
    attn = hf.model.layers[0].self_attn
    want_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    step = want_qkv.abs().view(-1, 32).amax(-1).repeat_interleave(32).view_as(want_qkv) / 254
    assert ((layer.qkv.dequantize_rows() - want_qkv).abs() <= step * 1.0001).all()
    want = reference_logits(hf)
    assert relative(got, want) < 5e-2  # (this tiny random model's logits: ~3%)


def test_tensor_parallel_ranks_sum_to_the_whole_act_order_layer(tmp_path):
    """Row-parallel O and down hold input channels from every group on each rank: requantized
    to int8 per 32 there; column-parallel QKV and gate/up keep their order and int4."""
    hf = tiny_model()
    write_quantized(tmp_path, hf, SCHEMES["gptq-int4-asym-g32"], orders=shared_orders(3))
    whole, _ = load_model(str(tmp_path), "cpu", torch.float32)
    down = hf.model.layers[0].mlp.down_proj.weight
    x = torch.randn(3, down.shape[1], generator=torch.Generator().manual_seed(0))
    parts = []
    for rank in range(2):
        mine = shard_weights(whole.weights, whole.config, rank, 2).layers[0]
        assert mine.qkv.format == "int4" and mine.qkv.input_index is not None
        assert mine.down.format == "int8" and mine.down.input_index is None
        parts.append(ops.quant_linear(x[:, rank * 128 : (rank + 1) * 128], mine.down))
    want = x @ down.T
    assert relative(parts[0] + parts[1], want) < 1e-2


def test_act_order_experts_load_as_int8_per_32(tmp_path):
    """Each expert saw tokens of its own, so each has its own order: no MoE kernel gathers by
    one, so the experts are requantized to int8 per 32; the attention keeps its order."""
    counter = iter(range(1000))

    def own_orders(name: str, k: int) -> torch.Tensor:
        return torch.randperm(k, generator=torch.Generator().manual_seed(next(counter)))

    folder, reference = write_moe_gptq(tmp_path, own_orders)
    model, got = cpu_logits(folder)
    layer = model.weights.layers[0]
    assert layer.experts_gate_up.kind == layer.experts_down.kind == ("int8", 32, False)
    assert layer.o.format == "int4" and layer.o.input_index is not None
    want_down = reference.model.layers[0].mlp.experts.down_proj[1]  # [H, I]
    got_down = layer.experts_down.expert(1).dequantize_rows()
    step = want_down.abs().view(-1, 32).amax(-1).repeat_interleave(32).view_as(want_down) / 254
    assert ((got_down - want_down).abs() <= step * 1.0001).all()
    want = reference_logits(reference)
    assert relative(got, want) < 5e-2


def _act_order(qw: QuantizedWeight, seed: int) -> QuantizedWeight:
    """qw stored in a random input order (its columns are x[:, order]'s)."""
    k = qw.shape[1]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(
        qw.format, qw.shape, qw.qweight, qw.scales, qw.mins, qw.group_size, input_index=order
    )


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", 0)])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_quant_linear_gathers_x_by_the_input_order(fmt, group, backend):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 256, generator=g) * 0.05
    plain = quantize_int8(w) if fmt == "int8" else quantize_int4(w, group)
    qw = _act_order(plain, 1)
    x = torch.randn(5, 256, generator=g)
    with ops.use_backend(backend):
        got = ops.quant_linear(x, qw)
        unordered = ops.quant_linear(x, plain)
    want = reference_linear(x.double(), qw)  # (the float64 weight, its columns put back)
    assert relative(reference_linear(x[:, qw.input_index].double(), plain), want) < 1e-12
    tolerance = 1e-4 if backend == "cpu" else 2e-2
    assert relative(got.double(), want) < tolerance
    assert relative(unordered.double(), want) > 0.1  # (the order matters)
    state = QuantizedWeight.from_state_dict("w", qw.state_dict("w"))
    assert torch.equal(state.input_index, qw.input_index)


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
@pytest.mark.parametrize("m", [3, 80])  # the kernel's M, and a prefill's dequantized GEMM
def test_the_cuda_path_gathers_x_in_the_emulator(m):
    g = torch.Generator().manual_seed(9)
    qw = _act_order(quantize_int4(torch.randn(24, 384, generator=g) * 0.05, 128), 2)
    x = torch.randn(m, 384, generator=g).half()
    with emulated(expect_launch=m <= 64):
        got = ops.quant_linear(x, qw)
    want = reference_linear(x, qw)
    assert not got.isnan().any()
    assert relative(got.double(), want.double()) < 2e-2


def test_a_bad_input_index_is_refused_by_name():
    qw = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match=r"input_index torch.int32 \(64,\) must be int64"):
        QuantizedWeight(
            "int4", qw.shape, qw.qweight, qw.scales, qw.mins, 32,
            input_index=torch.arange(64, dtype=torch.int32),
        )  # fmt: skip
