"""Small HF model folders for the model tests (random weights saved with safetensors, a small
byte-level BPE tokenizer trained with `tokenizers`) and a dense float64 forward written with HF's
conventions (rotate-half RoPE, Llama 3 frequency scaling, biases) to check the loaders against."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from pagedkern.model import SequenceChunk, build_batch

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIALS += ["<|eot_id|>"]
CORPUS = ["the capital of France is Paris", "法国的首都是巴黎", "def f(x): return x + 1"] * 20


def train_tokenizer() -> Backend:
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def add_gguf_tokenizer(writer, bos: bool = False) -> list[str]:
    """The test tokenizer into a GGUFWriter, as llama.cpp's converter writes a BPE one (the gpt2
    model, merges, special tokens as control, the Llama 3 template); its tokens in id order."""
    vocab = json.loads(train_tokenizer().to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in vocab["merges"]])
    if bos:
        writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|eot_id|>"))
    writer.add_chat_template(LLAMA3_TEMPLATE)
    return tokens


def gguf_writer_like_llama_cpp(path, cfg, arch: str, head_dim: int):
    """A GGUFWriter holding what llama.cpp's converter writes for every decoder of a transformers
    config: the shape metadata (head_dim as key/value length) and the test tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_gguf_tokenizer(w)
    return w


def finish_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // nh)
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)

    def rnd(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std or shape[-1] ** -0.5)

    out = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + rnd(h, std=0.1)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = rnd(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = 1 + rnd(h, std=0.1)
        out[p + "post_attention_layernorm.weight"] = 1 + rnd(h, std=0.1)
        for name, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            out[p + f"self_attn.{name}_proj.weight"] = rnd(rows, h)
            if qkv_bias:
                out[p + f"self_attn.{name}_proj.bias"] = rnd(rows, std=0.5)
        out[p + "self_attn.o_proj.weight"] = rnd(h, nh * d)
        if cfg.get("attention_bias"):
            out[p + "self_attn.o_proj.bias"] = rnd(h, std=0.1)
        for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            out[p + f"mlp.{name}_proj.weight"] = rnd(*shape)
            if cfg.get("mlp_bias"):
                out[p + f"mlp.{name}_proj.bias"] = rnd(shape[0], std=0.1)
    return out


def write_folder(folder, cfg: dict, shards: int = 1, dtype=torch.float32, seed: int = 0):
    """A HF model folder; returns the float64 tensors it holds (as rounded to `dtype`)."""
    tensors = {k: t.to(dtype) for k, t in hf_tensors(cfg, seed).items()}
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k].contiguous() for k in names[s::shards]}
            save_file(part, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tokenizer(folder)
    return {k: t.double() for k, t in tensors.items()}


def write_tokenizer(folder) -> None:
    """tokenizer.json (a small byte-level BPE), tokenizer_config.json with a chat template, and
    generation_config.json naming the end of turn."""
    tok = train_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|end_of_text|>", "special": True},
        "chat_template": LLAMA3_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    eot = tok.token_to_id("<|eot_id|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot]}))


def base_config(**changes) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 400,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    cfg.update(changes)
    return cfg


def inv_freq_hf(cfg: dict, d: int) -> torch.Tensor:
    """HF's default / linear / llama3 RoPE frequencies, float64."""
    inv = cfg["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind != "llama3":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def dense_logits(t: dict, cfg: dict, ids: list[int]) -> torch.Tensor:
    n, h = len(ids), cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // nh)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq_hf(cfg, d)
    cos = torch.cat([angle.cos()] * 2, -1)[:, None]
    sin = torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(x):
        rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * w

    def lin(x, name):
        out = x @ t[name + ".weight"].T
        return out + t[name + ".bias"] if name + ".bias" in t else out

    x = t["model.embed_tokens.weight"][ids]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = rms(x, t[p + "input_layernorm.weight"])
        q = rope(lin(a, p + "self_attn.q_proj").view(n, nh, d))
        k = rope(lin(a, p + "self_attn.k_proj").view(n, nkv, d)).repeat_interleave(nh // nkv, 1)
        v = lin(a, p + "self_attn.v_proj").view(n, nkv, d).repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + lin(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1), p + "self_attn.o_proj")
        m = rms(x, t[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(lin(m, p + "mlp.gate_proj")) * lin(m, p + "mlp.up_proj")
        x = x + lin(act, p + "mlp.down_proj")
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rms(x, t["model.norm.weight"]) @ head.T


def all_logits(model, ids: list[int]) -> torch.Tensor:
    kv = model.allocate_kv_cache(16, 8)
    input_ids, meta = build_batch([SequenceChunk(ids, 0, list(range(16)))], 8)
    return model.compute_logits(model.hidden_states(input_ids, meta, kv))
