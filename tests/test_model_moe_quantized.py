"""Quantized experts kept quantized: GGUF MoE files whose layer matrices are Q4_0 / Q4_1
(experts included) load in int4 mode with the experts as stacked int4 QuantizedWeights (the
codes and scales of the file, no float detour), Q8_0 experts in int8 mode as int8; the model on
the CPU int kernels equals the same file dequantized at load within those kernels' tolerance
(bf16 activations), and transformers' model over the same (dequantized) weights, greedy tokens
equal. HF folders quantize their experts at load in int4 / int8 mode, as the dense layers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from hf_model_files import all_logits
from test_model_moe import _save
from test_model_moe_gguf import quantized, write_moe_gguf
from test_model_transformers import PROMPT
from transformers_oracle import engine_greedy, hf_greedy, hf_logits, relative

from pagedkern import ops
from pagedkern.model import load_model
from pagedkern.model.gguf_loader import gguf_default_quantization
from pagedkern.model.loading import gemm_weights
from pagedkern.model.weight_quantization import experts_in_one_form
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.variants import use_kernels
from pagedkern.reference.quantized_weight import QuantizedWeight

transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
COMMON = dict(
    vocab_size=400, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
# Every layer matrix a whole number of 32-blocks (the expert, dense and shared sizes)
CONFIGS = {
    "qwen3moe": (lambda **kw: transformers.Qwen3MoeConfig(**({
        "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 6,
        "num_experts_per_tok": 3, "norm_topk_prob": True, "mlp_only_layers": [1]} | COMMON | kw),
    ), "Qwen3MoeForCausalLM"),
    "llama": (lambda: transformers.MixtralConfig(
        intermediate_size=64, num_local_experts=5, num_experts_per_tok=2, **COMMON,
    ), "MixtralForCausalLM"),
    "qwen2moe": (lambda: transformers.Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **COMMON,
    ), "Qwen2MoeForCausalLM"),
}  # fmt: skip
# The int kernels multiply bf16 activations in every GEMM of the 3 layers (and the int4
# model's LM head is int8, requantized from F32): its logits against the same weights in fp32,
# relative (measured 2-6% on these peaked tiny models; a misplaced code or scale costs O(1))
KERNEL_TOLERANCE = 0.1


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


def _representable(hf, kind) -> None:
    """Round every matrix the file will hold in `kind` (the layers' 32-block matrices but the
    router) through it, so transformers' model holds the weights the file stands for."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            last = p.shape[-1]
            if not name.startswith("model.layers.") or p.dim() < 2 or last % 32:
                continue
            if name.endswith("mlp.gate.weight"):  # the router stays F32
                continue
            arr = p.detach().float().numpy().reshape(-1, last)
            p.copy_(torch.from_numpy(dequantize(quantize(arr, kind), kind).reshape(p.shape)))


def _gguf(tmp_path, arch, kind):
    make_config, model_class = CONFIGS[arch]
    hf = _save(tmp_path / "hf", make_config, model_class, lambda m: _representable(m, kind))
    path = tmp_path / f"{arch}-{kind.name}.gguf"
    write_moe_gguf(path, hf, arch, expert_type=kind, dense_type=kind)
    return path, hf


def _moe_layers(model):
    return [layer for layer in model.weights.layers if layer.router is not None]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_q4_experts_load_as_int4_and_match_the_dequantized_model(tmp_path, arch):
    path, hf = _gguf(tmp_path, arch, Q.Q4_0)
    assert gguf_default_quantization(path) == "int4"
    quantized, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization=None
    )
    plain, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="none"
    )
    for got, want in zip(_moe_layers(quantized), _moe_layers(plain), strict=True):
        for field in ("experts_gate_up", "experts_down"):
            w = getattr(got, field)
            assert isinstance(w, QuantizedWeight) and w.format == "int4" and w.group_size == 32
            assert w.shape == tuple(getattr(want, field).shape)
            # the file's codes: dequantized they are the float model's weights, exactly
            assert torch.equal(w.dequantize_rows(), getattr(want, field)), field
    got = all_logits(quantized, PROMPT).double()
    want = all_logits(plain, PROMPT).double()
    assert relative(got, want) < KERNEL_TOLERANCE
    assert relative(want, hf_logits(hf, PROMPT)) < 1e-5  # the dequantized model is exact
    assert relative(got, hf_logits(hf, PROMPT)) < KERNEL_TOLERANCE


def test_q4_1_experts_map_onto_int4_too(tmp_path):
    path, _ = _gguf(tmp_path, "qwen3moe", Q.Q4_1)
    quantized, _ = load_model(str(path), "cpu", torch.float32, quantization="int4")
    plain, _ = load_model(str(path), "cpu", torch.float32, quantization="none")
    layer, float_layer = _moe_layers(quantized)[0], _moe_layers(plain)[0]
    assert isinstance(layer.experts_down, QuantizedWeight)
    assert torch.equal(layer.experts_down.dequantize_rows(), float_layer.experts_down)
    got = all_logits(quantized, PROMPT).double()
    assert relative(got, all_logits(plain, PROMPT).double()) < KERNEL_TOLERANCE


def test_q4_k_experts_load_exactly_and_run_the_int4_k_tiles(tmp_path):
    """Q4_K experts (a Q4_K_M file's): int4 with fp32 scales and mins that dequantize to the
    file's values bit for bit (fp16 cannot hold Q4_K's d sc; the file dequantized at load is
    transformers' model on the same weights), run on the CPU as int4_k tiles: the layer's
    fused_moe within the 16-bit activations' error of the float experts'."""
    make_config, model_class = CONFIGS["qwen3moe"]
    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256)

    def experts_in_q4_k(hf) -> None:  # transformers' model holds the file's expert weights
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if ".mlp.experts." in name:
                    rows = p.detach().float().numpy().reshape(-1, p.shape[-1])
                    back = dequantize(quantized(rows, Q.Q4_K), Q.Q4_K).reshape(p.shape)
                    p.copy_(torch.from_numpy(back))

    hf = _save(tmp_path / "hf", lambda: make_config(**sizes), model_class, experts_in_q4_k)
    path = tmp_path / "q4_k.gguf"
    write_moe_gguf(path, hf, "qwen3moe", expert_type=Q.Q4_K)
    quantized_model, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="int4"
    )
    plain, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization="none"
    )
    assert relative(all_logits(plain, PROMPT).double(), hf_logits(hf, PROMPT)) < 1e-5
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for got, want in zip(_moe_layers(quantized_model), _moe_layers(plain), strict=True):
        for field in ("experts_gate_up", "experts_down"):
            w = getattr(got, field)
            assert isinstance(w, QuantizedWeight) and w.format == "int4"
            assert w.scales.dtype == torch.float32
            assert torch.equal(w.dequantize_rows(), getattr(want, field)), field
            if quant_gemv.available():
                assert quant_gemv.tile_format(w.expert(0)) == "int4_k", field
        logits = hidden @ want.router.T
        args = dict(top_k=3, renormalize=True)
        out = ops.fused_moe(hidden, logits, got.experts_gate_up, got.experts_down, **args)
        exact = ops.fused_moe(hidden, logits, want.experts_gate_up, want.experts_down, **args)
        assert not out.isnan().any() and relative(out.double(), exact.double()) < 1e-3


def test_a_down_projection_in_another_type_keeps_its_own_form(tmp_path):
    # Q4_0 gate/up, Q8_0 down (as Q4_K_M files put down in Q6_K): in int4 mode each keeps the
    # file's codes (int4, int8 per 32) and the CPU kernel takes both forms; for CUDA's fused
    # kernel (one form for both GEMMs) gemm_weights requantizes down to gate/up's int4
    make_config, model_class = CONFIGS["qwen3moe"]
    hf = _save(tmp_path / "hf", make_config, model_class)
    path = tmp_path / "mixed.gguf"
    write_moe_gguf(path, hf, "qwen3moe", expert_type=Q.Q4_0, down_type=Q.Q8_0, dense_type=Q.Q4_0)
    quantized, _ = load_model(str(path), "cpu", torch.float32, quantization="int4")
    plain, _ = load_model(str(path), "cpu", torch.float32, quantization="none")
    layer, float_layer = _moe_layers(quantized)[0], _moe_layers(plain)[0]
    assert layer.experts_gate_up.kind == ("int4", 32, True)
    assert layer.experts_down.kind == ("int8", 32, False)
    for field in ("experts_gate_up", "experts_down"):  # the file's values exactly
        assert torch.equal(getattr(layer, field).dequantize_rows(), getattr(float_layer, field))
    got = all_logits(quantized, PROMPT).double()
    assert relative(got, all_logits(plain, PROMPT).double()) < KERNEL_TOLERANCE
    with use_kernels(cpu_moe="loop"):  # the host loop over the same two forms
        assert relative(all_logits(quantized, PROMPT).double(), got) < 1e-4

    one = experts_in_one_form(layer)
    assert one.experts_gate_up is layer.experts_gate_up
    assert one.experts_down.kind == ("int4", 32, True)
    error = relative(one.experts_down.dequantize_rows().double(), float_layer.experts_down)
    assert 0 < error < 0.15  # int4's step over Q8_0's values
    cuda_form = gemm_weights(quantized.weights, torch.device("cuda"), torch.float16)
    moe = [w for w in cuda_form.layers if w.router is not None]
    assert all(w.experts_gate_up.kind == w.experts_down.kind for w in moe)


def test_greedy_tokens_equal_transformers(tmp_path):
    path, hf = _gguf(tmp_path, "qwen3moe", Q.Q4_0)
    want, _ = hf_greedy(hf, PROMPT, 8)
    outputs = engine_greedy(path, PROMPT, 8, quantization="int4")
    assert [t for out in outputs for t in out.token_ids] == want


def test_q8_0_experts_load_as_int8(tmp_path):
    path, hf = _gguf(tmp_path, "llama", Q.Q8_0)
    assert gguf_default_quantization(path) == "int8"  # (the file's own precision)
    quantized, _ = load_model(str(path), "cpu", torch.float32, quantization=None)
    plain, _ = load_model(str(path), "cpu", torch.float32, quantization="none")
    layer = _moe_layers(quantized)[0]
    for w in (layer.experts_gate_up, layer.experts_down):
        assert isinstance(w, QuantizedWeight) and (w.format, w.group_size) == ("int8", 32)
    assert layer.experts_gate_up.shape == (5, 128, 64)
    # int8 with Q8_0's per-32 scales: the file's values exactly
    want = _moe_layers(plain)[0]
    assert torch.equal(layer.experts_gate_up.dequantize_rows(), want.experts_gate_up)
    assert torch.equal(layer.experts_down.dequantize_rows(), want.experts_down)
    got = all_logits(quantized, PROMPT).double()
    assert relative(got, all_logits(plain, PROMPT).double()) < KERNEL_TOLERANCE


def test_hf_folders_quantize_their_experts_at_load(tmp_path):
    make_config, model_class = CONFIGS["qwen2moe"]
    _save(tmp_path, make_config, model_class)
    plain, _ = load_model(str(tmp_path), "cpu", torch.float32)
    float_experts = plain.weights.layers[0].experts_down.double()
    # quantization noise of the weights: int8 per channel ~0.4%, int4 (G = 32) ~11%
    for mode, noise in (("int8", 1e-2), ("int4", 0.15)):
        model, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization=mode)
        layer = model.weights.layers[0]
        assert layer.experts_gate_up.format == mode and layer.experts_down.format == mode
        assert layer.experts_gate_up.shape == (4, 64, 64) and layer.experts_down.shape == (
            4,
            64,
            32,
        )
        assert isinstance(layer.gate_up, QuantizedWeight)  # the shared expert: a dense MLP
        assert relative(layer.experts_down.dequantize_rows().double(), float_experts) < noise
        if mode == "int8":  # (int4's noise moves these peaked logits by tens of percent)
            got = all_logits(model, PROMPT).double()
            assert relative(got, all_logits(plain, PROMPT).double()) < 0.1


def test_experts_whose_sizes_do_not_divide_stay_float(tmp_path):
    # I = 40: the down projection's rows are not whole 32-blocks; neither GEMM is quantized
    cfg = lambda: transformers.MixtralConfig(  # noqa: E731
        intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, **COMMON
    )
    _save(tmp_path, cfg, "MixtralForCausalLM")
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="int8")
    layer = model.weights.layers[0]
    assert isinstance(layer.qkv, QuantizedWeight)
    assert isinstance(layer.experts_gate_up, torch.Tensor)
    assert layer.experts_down.dtype == torch.float32


def test_stacked_experts_survive_the_weights_cache(tmp_path):
    path, _ = _gguf(tmp_path, "qwen3moe", Q.Q4_0)
    first, _ = load_model(str(path), "cpu", torch.float32, quantization="int4")
    again, _ = load_model(str(path), "cpu", torch.float32, quantization="int4")  # a cache hit
    a, b = _moe_layers(first)[0].experts_down, _moe_layers(again)[0].experts_down
    assert isinstance(b, QuantizedWeight) and b.shape == a.shape
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert np.array_equal(a.mins.numpy(), b.mins.numpy())


def test_graph_policy_knows_which_quantized_experts_the_kernel_covers(tmp_path):
    # (on a GPU, experts outside the W4A16 / W8A16 kernel run a host loop: no decode graphs)
    from pagedkern.engine.kernel_policy import quantized_experts_support

    make_config, model_class = CONFIGS["qwen2moe"]  # H = 64, I = 32
    _save(tmp_path, make_config, model_class)
    plain, _ = load_model(str(tmp_path), "cpu", torch.bfloat16)
    assert quantized_experts_support(plain) is None  # float experts: the float kernel's table
    covered, _ = load_model(str(tmp_path), "cpu", torch.bfloat16, quantization="int4")
    assert quantized_experts_support(covered).supported
    fp32, _ = load_model(str(tmp_path), "cpu", torch.float32, quantization="int8")
    decision = quantized_experts_support(fp32)
    assert not decision.supported and "float32" in decision.reason
