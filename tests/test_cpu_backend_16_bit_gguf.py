"""An F16 / BF16 GGUF file on the CPU backend: as a 16-bit HF checkpoint's, its dense layers'
projections, embedding and LM head stay 16-bit in memory (and in the converted-weights cache)
while the model computes in fp32, so its logits, greedy tokens and logprobs are bit for bit
those of the same values widened to fp32 at load (what the loader did before)."""

from __future__ import annotations

import gguf
import pytest
import torch
from hf_model_files import base_config, dense_logits
from test_cpu_backend_16_bit_weights import sampled
from test_model_gguf import TEXT, all_logits, write_gguf

from pagedkern.engine import Engine, EngineConfig
from pagedkern.model import LlamaModel, load_model
from pagedkern.model.gguf_loader import load_gguf
from pagedkern.ops.cpu import quant_gemv

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")
TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(params=[("F16", "llama"), ("BF16", "qwen2")])
def gguf_file(request, tmp_path):
    """(path, the 16-bit dtype, the HF-layout tensors it holds, the config); qwen2's embedding
    tied to its head, llama's Q/K permuted as llama.cpp's converter does."""
    kind, arch = request.param
    if arch == "llama":
        cfg = base_config()
    else:
        cfg = base_config(model_type="qwen2", tie_word_embeddings=True)
    path = tmp_path / "m.gguf"
    expected = write_gguf(path, cfg, arch, matrices=gguf.GGMLQuantizationType[kind])
    return path, TYPES[kind], expected, cfg


def widened(path) -> LlamaModel:
    """The same file's model with every weight in fp32 (the loader's old result)."""
    config, weights, _ = load_gguf(path, quantization="none")  # (keep_16_bit off)
    assert weights.layers[0].qkv.dtype == weights.lm_head.dtype == torch.float32
    return LlamaModel(config, weights, kv_cache_dtype="float32")


def test_the_projections_stay_16_bit_and_the_rest_fp32(gguf_file):
    path, dtype, expected, _ = gguf_file
    for _ in range(2):  # converted, then from the cache
        model, _ = load_model(path, "cpu")
        w, layer = model.weights, model.weights.layers[0]
        assert model.quantization == "none"
        assert {layer.qkv.dtype, layer.o.dtype, layer.gate_up.dtype, layer.down.dtype} == {dtype}
        assert w.lm_head.dtype == w.embed.dtype == dtype
        assert w.tied == (dtype == torch.bfloat16)
        assert w.norm.dtype == layer.input_norm.dtype == torch.float32
        assert torch.equal(w.embed.double(), expected["model.embed_tokens.weight"])


def test_other_modes_and_dtypes_are_unchanged(gguf_file):
    path = gguf_file[0]
    model, _ = load_model(path, "cpu", quantization="int8")
    assert model.weights.layers[0].qkv.format == "int8"
    model, _ = load_model(path, "cpu", torch.bfloat16)
    assert model.weights.layers[0].qkv.dtype == torch.bfloat16  # (bf16 activations: as asked)


def test_logits_tokens_and_logprobs_are_the_widened_models_bits(gguf_file):
    path, _, expected, cfg = gguf_file
    model, tok = load_model(path, "cpu", kv_cache_dtype="float32")  # (exact K/V: dense_logits)
    full = widened(path)
    ids = tok.encode(TEXT)
    got = all_logits(model, ids)
    assert torch.equal(got, all_logits(full, ids))
    assert (got - dense_logits(expected, cfg, ids)).abs().max().item() < 1e-4
    runs = []
    for m in (model, full):
        config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8)
        runs.append(sampled(Engine(m, tok, config), [ids, ids[4:]]))
    assert runs[0] == runs[1]
    assert all(len(r) == 10 for r in runs[0])
