"""The GGUF loader on small files written here with gguf.GGUFWriter the way llama.cpp's converter
writes them (Q/K permuted for interleaved RoPE on "llama", Q8_0 weights, tokenizer metadata),
and the converted-weights cache."""

from __future__ import annotations

import warnings
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from hf_model_files import add_gguf_tokenizer, base_config, dense_logits, finish_gguf, hf_tensors

from pagedkern.model import ModelLoadError, SequenceChunk, build_batch, load_model, weights_cache
from pagedkern.model.quantized_linear import QuantizedWeight
from pagedkern.model.weights_cache import cache_root
from pagedkern.ops.cpu import quant_gemv

Q8 = gguf.GGMLQuantizationType.Q8_0


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_tensor_name(name: str) -> str:
    """A HF tensor name as convert_hf_to_gguf.py names it in the GGUF."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER[module]}.{kind}"


def q6_k_bytes(arr: np.ndarray, seed: int) -> np.ndarray:
    """Random Q6_K blocks of arr's shape (gguf has no Q6_K quantizer): 6-bit q, int8 sub-scales
    in -8..8 and d = 1e-4, so |w| <= 0.026 (the random weights' size)."""
    n, k = arr.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    blocks[:, 192:208] = rng.integers(-8, 9, size=(len(blocks), 16)).astype(np.int8).view(np.uint8)
    blocks[:, 208:] = np.full(len(blocks), 1e-4, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def q5_k_bytes(arr: np.ndarray, seed: int) -> np.ndarray:
    """Random Q5_K blocks of arr's shape (gguf has no Q5_K quantizer): 5-bit q, 6-bit sub-scales
    and mins, d = dmin = 1e-5, so w = d sc q - dmin mn lies in -0.0007..0.02."""
    n, k = arr.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // 256, 176), dtype=np.uint8)
    blocks[:, :4] = np.full((len(blocks), 2), 1e-5, dtype=np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def code_bytes(kind: str, d: float):
    """Random `kind` blocks (Q3_K, IQ4_XS, IQ4_NL: gguf has no quantizer for them) of arr's
    shape: random codes and sub-scales, every block's d = `d` (small: |w| <= 0.02)."""
    size, per_block = {"Q3_K": (110, 256), "IQ4_XS": (136, 256), "IQ4_NL": (18, 32)}[kind]
    at = slice(-2, None) if kind == "Q3_K" else slice(0, 2)

    def blocks(arr: np.ndarray, seed: int) -> np.ndarray:
        n, k = arr.shape
        raw = np.random.default_rng(seed).integers(0, 256, (n * k // per_block, size), np.uint8)
        raw[:, at] = np.full(len(raw), d, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        return raw.reshape(n, -1)

    return blocks


RANDOM_BLOCKS = {
    gguf.GGMLQuantizationType.Q6_K: q6_k_bytes,
    gguf.GGMLQuantizationType.Q5_K: q5_k_bytes,
    gguf.GGMLQuantizationType.Q3_K: code_bytes("Q3_K", 1e-4),
    gguf.GGMLQuantizationType.IQ4_XS: code_bytes("IQ4_XS", 5e-6),
    gguf.GGMLQuantizationType.IQ4_NL: code_bytes("IQ4_NL", 1e-4),
}


def write_gguf(
    path, cfg: dict, arch: str = "llama", skip: str = "", seed: int = 0, types=None, matrices=Q8
) -> dict:
    """A GGUF of the HF-style config; returns the float64 HF-layout tensors as dequantized.
    types: GGUF name -> its type for matrices (default `matrices`, Q8_0; Q6_K, Q5_K: random
    blocks; F16 and BF16: the values rounded)."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    cfg["vocab_size"] = len(add_gguf_tokenizer(w, bos=True))
    expected = {}
    for i, (name, t) in enumerate(hf_tensors(cfg, seed).items()):
        arr = t.numpy().astype(np.float32)
        gname = llama_cpp_tensor_name(name)
        kind = (types or {}).get(gname, matrices)
        raw = None
        if arr.ndim == 2:  # quantized once: the file's blocks, and the values they hold
            raw = RANDOM_BLOCKS[kind](arr, seed * 1000 + i) if kind in RANDOM_BLOCKS else None
            raw = quantize(arr, kind) if raw is None else raw
            arr = dequantize(raw, kind).reshape(arr.shape)
        expected[name] = torch.from_numpy(arr.astype(np.float64))
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = nh if "q_proj" in name else nkv
            arr = llama_cpp_permute(arr, heads)
            raw = None if raw is None else llama_cpp_permute(raw, heads)  # (whole rows of blocks)
        if gname == skip:
            continue
        if raw is not None:
            w.add_tensor(gname, raw, raw_dtype=kind)
        else:
            w.add_tensor(gname, arr)
    finish_gguf(w)
    return expected


def all_logits(model, ids):
    kv = model.allocate_kv_cache(8, 16)
    batch, meta = build_batch([SequenceChunk(ids, 0, list(range(8)))], 16)
    return model.compute_logits(model.hidden_states(batch, meta, kv)).double()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


TEXT = "the capital of France is Paris; 法国的首都是巴黎. Quick brown foxes!"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_dense(tmp_path, arch):
    if arch == "llama":
        cfg = base_config(rope_theta=500000.0)
    else:
        cfg = base_config(model_type="qwen2", tie_word_embeddings=True)
    expected = write_gguf(tmp_path / "m.gguf", cfg, arch)
    model, tok = load_model(tmp_path / "m.gguf", quantization="none", kv_cache_dtype="float32")
    assert model.config.vocab_size == cfg["vocab_size"]
    assert model.config.qkv_bias == (arch == "qwen2") and model.weights.tied == (arch == "qwen2")
    ids = tok.encode(TEXT)
    got = all_logits(model, ids)
    want = dense_logits(expected, cfg, ids)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() < 1e-4
    assert tok.decode(ids) == TEXT
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(
        "<|begin_of_text|><|start_header_id|>user"
    )
    assert tok.token_to_id("<|eot_id|>") in tok.stop_token_ids


def test_a_q4_k_m_shaped_file_keeps_each_tensors_precision(tmp_path):
    """Q4_0 layers with Q6_K v, down and head, as llama-quantize's Q4_K_M mixes them (and a Q6_K
    o, one more unfused weight): the default is int4; down, o and the head are int8 with a scale
    per 16, the file's values exactly; q/k/v, fused with parts of two forms, are int8 with a
    scale per 32 of their values (within half a step of each group); the logits are the file's
    dense model's within that rounding."""
    q4, q6 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q6_K
    cfg = base_config(hidden_size=256, intermediate_size=256)
    types = {}
    for layer in range(cfg["num_hidden_layers"]):
        for part in ("attn_q", "attn_k", "ffn_gate", "ffn_up"):
            types[f"blk.{layer}.{part}.weight"] = q4
        for part in ("attn_v", "ffn_down", "attn_output"):
            types[f"blk.{layer}.{part}.weight"] = q6
    types["output.weight"] = q6
    expected = write_gguf(tmp_path / "m.gguf", cfg, "llama", types=types)
    model, tok = load_model(tmp_path / "m.gguf", use_cache=False)
    assert model.quantization == "int4"
    w = model.weights
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for qw, name in ((w.layers[i].down, "mlp.down_proj"), (w.layers[i].o, "self_attn.o_proj")):
            assert (qw.format, qw.group_size) == ("int8", 16)
            assert torch.equal(qw.dequantize_rows(), expected[p + name + ".weight"].float())
        assert (w.layers[i].gate_up.format, w.layers[i].gate_up.group_size) == ("int4", 32)
        qkv = w.layers[i].qkv  # (parts of two forms)
        assert (qkv.format, qkv.group_size, qkv.mins) == ("int8", 32, None)
        want = torch.cat([expected[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        step = want.abs().view(-1, 32).amax(-1, keepdim=True) / 127
        assert ((qkv.dequantize_rows().double() - want).view(-1, 32).abs() <= step * 0.501).all()
    assert (w.lm_head.format, w.lm_head.group_size) == ("int8", 16)
    assert torch.equal(w.lm_head.dequantize_rows(), expected["lm_head.weight"].float())
    ids = tok.encode(TEXT)
    got, want = all_logits(model, ids), dense_logits(expected, cfg, ids)
    assert (got - want).abs().max().item() < 0.01 * want.abs().max().item()  # (int4 qkv: 3.6%)


def test_a_q5_k_m_shaped_file_keeps_each_tensors_precision(tmp_path):
    """Q5_K layers with Q6_K down and head, as llama-quantize's Q5_K_M mixes them, and Q5_0 /
    Q5_1 gate and up (the legacy 5-bit blocks): the default is int8; every matrix is the file's
    values exactly (codes with a scale and a min per 32, or a scale per 16), the fused ones
    included (all three 5-bit kinds are one form); the CPU GEMM runs their own tiles, and the
    logits are the file's dense model's within the 16-bit activations' rounding."""
    t = gguf.GGMLQuantizationType
    cfg = base_config(hidden_size=256, intermediate_size=512)
    types = {"output.weight": t.Q6_K}
    for layer in range(cfg["num_hidden_layers"]):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            types[f"blk.{layer}.{part}.weight"] = t.Q5_K
        types[f"blk.{layer}.ffn_down.weight"] = t.Q6_K
        types[f"blk.{layer}.ffn_gate.weight"] = t.Q5_0 if layer == 0 else t.Q5_1
        types[f"blk.{layer}.ffn_up.weight"] = t.Q5_0
    expected = write_gguf(tmp_path / "m.gguf", cfg, "llama", types=types)
    model, tok = load_model(tmp_path / "m.gguf", use_cache=False)
    assert model.quantization == "int8"
    w = model.weights

    def exact(qw, names, group, mins):
        assert isinstance(qw, QuantizedWeight) and (qw.format, qw.group_size) == ("int8", group)
        assert (qw.mins is not None) == mins
        want = torch.cat([expected[n] for n in names]).float()
        assert torch.equal(qw.dequantize_rows(), want)

    for i in range(cfg["num_hidden_layers"]):
        p, layer = f"model.layers.{i}.", w.layers[i]
        exact(layer.qkv, [p + f"self_attn.{x}_proj.weight" for x in "qkv"], 32, True)
        exact(layer.o, [p + "self_attn.o_proj.weight"], 32, True)
        exact(layer.down, [p + "mlp.down_proj.weight"], 16, False)
        exact(layer.gate_up, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], 32, True)
    exact(w.lm_head, ["lm_head.weight"], 16, False)
    if quant_gemv.available():
        assert quant_gemv.tile_format(w.layers[0].qkv) == "int5_g32"
        assert quant_gemv.tile_format(w.layers[0].down) == "int6_k"  # Q6_K's own scales
    ids = tok.encode(TEXT)
    got, want = all_logits(model, ids), dense_logits(expected, cfg, ids)
    assert 0 < (got - want).abs().max().item() < 2e-3 * want.abs().max().item()


def test_cache_hit_skips_parsing_and_damage_rebuilds(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, base_config())
    first, tok = load_model(path)
    entries = list((tmp_path / "cache").glob("gguf*-v*/*"))
    assert len(entries) == 1 and (entries[0] / "weights.safetensors").is_file()
    with mock.patch("gguf.GGUFReader", side_effect=AssertionError("parsed the GGUF again")):
        second, tok2 = load_model(path)
    ids = tok.encode(TEXT)
    assert tok2.encode(TEXT) == ids
    assert torch.equal(all_logits(first, ids), all_logits(second, ids))
    # A damaged entry is dropped with a warning and rebuilt from the file.
    weights = entries[0] / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="unreadable cache entry"):
        third, _ = load_model(path)
    assert torch.equal(all_logits(third, ids), all_logits(first, ids))
    assert (entries[0] / "complete").is_file()
    # Another file (other hash) gets its own entry; use_cache=False writes none.
    other = tmp_path / "other.gguf"
    write_gguf(other, base_config(), seed=1)
    load_model(other, use_cache=False)
    assert len(list((tmp_path / "cache").glob("gguf*-v*/*"))) == 1
    load_model(other)
    assert len(list((tmp_path / "cache").glob("gguf*-v*/*"))) == 2


def test_a_new_entry_drops_the_same_files_entries_of_older_formats(tmp_path, monkeypatch):
    """A conversion cached under an older CACHE_FORMAT is never read again: writing the file's
    new entry deletes it (other files' old entries and other kinds stay)."""
    path, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    write_gguf(path, base_config())
    write_gguf(other, base_config(), seed=1)
    root = tmp_path / "cache"
    monkeypatch.setattr(weights_cache, "CACHE_FORMAT", weights_cache.CACHE_FORMAT - 1)
    load_model(path)
    load_model(other)
    old = sorted(root.glob("gguf*-v*/*"))
    assert len(old) == 2
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(root))
    load_model(path)
    new = [e for e in root.glob("gguf*-v*/*") if e not in old]
    assert len(new) == 1 and (new[0] / "complete").is_file()
    digest = new[0].name
    remaining = sorted(root.glob("gguf*-v*/*"))
    assert [e.name for e in remaining].count(digest) == 1  # the old copy is gone
    assert any(e.name != digest for e in remaining)  # the other file's old entry stays


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDKERN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedkern"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "pagedkern"
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_unwritable_cache_only_warns(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(blocker / "cache"))
    write_gguf(tmp_path / "m.gguf", base_config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_model(tmp_path / "m.gguf")
    assert any("could not cache" in str(w.message) for w in caught)
    assert model.config.num_layers == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_architecture_is_read_for_the_default_dtype(tmp_path, monkeypatch, arch):
    """From the header's first key alone (llama.cpp's writers put it there; parsing the
    metadata takes seconds), and where another key comes first from the parsed metadata."""
    from pagedkern.model import gguf_loader

    path = tmp_path / "m.gguf"
    write_gguf(path, base_config(), arch=arch)
    parsed, parse = [], gguf_loader._open
    monkeypatch.setattr(gguf_loader, "_open", lambda p: parsed.append(p) or parse(p))
    assert gguf_loader.gguf_architecture(path) == arch and not parsed
    monkeypatch.setattr(gguf_loader, "_ARCH_KEY", b"general.name")  # (first: another key)
    assert gguf_loader.gguf_architecture(path) == arch and parsed


def test_gguf_missing_tensor_and_bad_arch(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, base_config(), skip="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    assert info.value.source == str(path) and "'blk.1.ffn_up.weight' is missing" in str(info.value)
    falcon = tmp_path / "falcon.gguf"
    write_gguf(falcon, base_config(), arch="falcon")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'falcon'"):
        load_model(falcon)


@pytest.mark.parametrize(
    "tensor, offset, value",
    [
        ("blk.1.ffn_up.weight", 34, b"\x00\x7e"),  # Q8_0's block 1 (34 bytes a block): d NaN
        ("output_norm.weight", 8, b"\x00\x00\x80\x7f"),  # F32 value 2: infinity
    ],
    ids=["a Q8_0 block's scale NaN", "an F32 norm's value infinite"],
)
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, tensor, offset, value):
    """A corrupt file's NaN or infinity is a load error naming the tensor, not a model that
    silently samples token 0: a quantized weight's scale as well as a float tensor's value."""
    path = tmp_path / "m.gguf"
    write_gguf(path, base_config())
    (info,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor]
    with open(path, "r+b") as f:
        f.seek(info.data_offset + offset)
        f.write(value)
    with pytest.raises(ModelLoadError, match=f"'{tensor}'.* holds NaN or infinite values"):
        load_model(path)


def toy_meta(pre: str, **extra) -> dict:
    """GGUF tokenizer metadata: the 256 byte symbols, two merges, one control token."""
    from tokenizers import pre_tokenizers

    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "12", "123", "<|bos|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["1 2", "12 3"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    meta.update(extra)
    return meta


@pytest.mark.parametrize(
    ("pre", "digit_tokens"),
    [
        ("default", ["123"]),
        ("smollm", ["1", "2", "3"]),
        ("llama-bpe", ["123"]),
        ("qwen2", list("123")),
        ("deepseek-r1-qwen", list("123")),
        ("gpt-4o", ["123"]),
        ("tekken", list("123")),
    ],
)
def test_gguf_pre_tokenizers(pre, digit_tokens):
    from pagedkern.model.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(toy_meta(pre, **{"tokenizer.ggml.add_bos_token": True}), "toy.gguf")
    ids = tok.encode("123")
    assert [tok.id_to_token(i) for i in ids] == digit_tokens
    assert tok.encode("123", add_special_tokens=True) == [tok.bos_token_id, *ids]
    text = "héllo 法国 🇫🇷 x=123"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-4o", ["I'm", "ĠHello", "World", "Ġ", "123", "45"]),
        ("tekken", ["I", "'m", "ĠHello", "World", "Ġ", "1", "2", "3", "4", "5"]),
        ("deepseek-r1-qwen", ["I", "'m", "ĠHelloWorld", "Ġ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", ["I", "'m", "ĠHelloWorld", "Ġ", "123", "45"]),
    ],
)
def test_gguf_pre_tokenizers_split_as_their_regexes(pre, pieces):
    """o200k's (gpt-oss), Mistral Nemo's tekken: cased words apart, contractions kept."""
    from pagedkern.model.gguf_tokenizer import tokenizer_from_gguf

    backend = tokenizer_from_gguf(toy_meta(pre), "toy.gguf").backend
    got = backend.pre_tokenizer.pre_tokenize_str("I'm HelloWorld 12345")
    assert [piece for piece, _ in got] == pieces


def test_gguf_tokenizer_errors():
    from pagedkern.model.gguf_tokenizer import tokenizer_from_gguf

    with pytest.raises(ModelLoadError, match="tokenizer model 't5'"):
        tokenizer_from_gguf(toy_meta("default", **{"tokenizer.ggml.model": "t5"}), "x.gguf")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'mystery'"):
        tokenizer_from_gguf(toy_meta("mystery"), "x.gguf")
    with pytest.raises(ModelLoadError, match="no vocabulary"):
        tokenizer_from_gguf(toy_meta("default", **{"tokenizer.ggml.tokens": []}), "x.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_q8_0_loads_straight_to_int8(tmp_path, arch, monkeypatch):
    """A Q8_0 file defaults to int8 mode, and its matrices become int8 with a scale per 32
    exactly (the file's values) without being dequantized to fp32 (the dequantizer sees only
    the norms and an untied embedding, which stays float and exact); a tied embedding is the
    int8 head. The logits are the float model's within the 16-bit activations' rounding."""
    import gguf.quants

    tied = arch == "qwen2"
    cfg = base_config(model_type="qwen2", tie_word_embeddings=True) if tied else base_config()
    expected = write_gguf(tmp_path / "m.gguf", cfg, arch)
    real = gguf.quants.dequantize
    shapes: list[tuple[int, ...]] = []

    def counting(data, qtype):
        out = real(data, qtype)
        shapes.append(out.shape)
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    model, tok = load_model(tmp_path / "m.gguf", use_cache=False)
    assert model.quantization == "int8"
    matrices = [s for s in shapes if len(s) == 2]  # besides the norms (F32)
    assert matrices == ([] if tied else [(cfg["vocab_size"], cfg["hidden_size"])])
    w = model.weights

    def check(qw, names):
        want = torch.cat([expected[n] for n in names]).float()
        assert isinstance(qw, QuantizedWeight) and (qw.format, qw.group_size) == ("int8", 32)
        assert torch.equal(qw.dequantize_rows(), want)

    p = "model.layers.0."
    check(w.layers[0].qkv, [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
    check(w.layers[0].down, [p + "mlp.down_proj.weight"])
    check(w.lm_head, ["model.embed_tokens.weight" if tied else "lm_head.weight"])
    ids = tok.encode(TEXT)
    got, want = all_logits(model, ids), dense_logits(expected, cfg, ids)
    assert 0 < (got - want).abs().max().item() < 2e-3 * want.abs().max().item()
    if tied:
        assert w.embed is w.lm_head
    else:
        assert torch.equal(w.embed.double(), expected["model.embed_tokens.weight"])
