"""Random-weight GGUFs of deployed model shapes, quantized Q4_0 by llama.cpp's own tools, for
comparing pagedkern with llama.cpp beyond the default 135M model
(bench/test_bench_cpu_vs_llamacpp.py):

- `llama-1b`: Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64,
  intermediate 8192, tied embeddings), ~1.07B parameters, ~0.6 GB as Q4_0: a decode token is
  bound by memory bandwidth, not per-op dispatch;
- `qwen3-0.6b`: Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query / 8 KV heads of 128,
  intermediate 3072, QK-norm, tied embeddings), ~0.44B parameters with this vocabulary;
- `qwen3-30b-a3b-4l`: 4 of Qwen3-30B-A3B's 48 layers at its width (hidden 2048, 32 query / 4 KV
  heads of 128, QK-norm, 128 experts of 768, top 8): ~2.6B parameters, ~1.4 GB as Q4_0, a
  decode token reading ~0.1 GB of routed experts (a 48-layer token reads 12x that).

Both take the default model's vocabulary (SmolLM2's 49152 tokens; its tokenizer rebuilt from
the GGUF, which llama.cpp's converter recognises as "smollm"). The weights are N(0, 0.02) and
the norms 1, so activations and logits stay finite through the layers.

Built once through llama.cpp's real path: an HF folder (config.json, the tokenizer, one f16
safetensors file) -> convert_hf_to_gguf.py --outtype f16 -> llama-quantize Q4_0. The result is
cached (PAGEDKERN_BENCH_CACHE, else <pagedkern's cache>/bench); the ~2 GB intermediates are
deleted once the Q4_0 file exists. A build takes a few minutes and ~5 GB of RAM on 2 CPUs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class RandomModel:
    name: str
    version: int  # bumped when the shape or the weights change: a cached file is never stale
    architecture: str  # config.json's architectures[0] (which converter llama.cpp runs)
    model_type: str
    shape: dict
    qk_norm: bool = False

    @property
    def file_name(self) -> str:
        return f"{self.name}-random-v{self.version}-q4_0.gguf"


MODELS = {
    model.name: model
    for model in (
        RandomModel(
            "llama-1b", 1, "LlamaForCausalLM", "llama",
            dict(
                hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True,
            ),
        ),
        RandomModel(
            "qwen3-0.6b", 1, "Qwen3ForCausalLM", "qwen3",
            dict(
                hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, intermediate_size=3072, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=True,
            ),
            qk_norm=True,
        ),
        RandomModel(
            "qwen3-30b-a3b-4l", 1, "Qwen3MoeForCausalLM", "qwen3_moe",
            dict(
                hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            ),
            qk_norm=True,
        ),
    )
}  # fmt: skip
_STD = 0.02
_SEED = 1234
# Runs convert_hf_to_gguf.py (argv[1]). Its Llama converter imports sentencepiece before it looks
# for tokenizer.model; this model has none (a byte-level BPE tokenizer.json), so where the
# package is absent that lookup is made to fail first, as it would with the package installed
# (FileNotFoundError), and the converter falls through to the BPE vocabulary.
_CONVERT = """
import os, runpy, sys
sys.argv = sys.argv[1:]
tree = os.path.dirname(os.path.abspath(sys.argv[0]))
sys.path[:0] = [tree, os.path.join(tree, "gguf-py")]  # the tree's gguf, as the script takes it
import conversion
read_sentencepiece = conversion.TextModel._create_vocab_sentencepiece
def create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return read_sentencepiece(self)
conversion.TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def cache_folder() -> Path:
    """PAGEDKERN_BENCH_CACHE, else the bench folder of pagedkern's own cache."""
    override = os.environ.get("PAGEDKERN_BENCH_CACHE")
    if override:
        return Path(override)
    from pagedkern.model.weights_cache import cache_root

    return cache_root() / "bench"


def converter_script(llama_bin: Path) -> Path | None:
    """convert_hf_to_gguf.py of the llama.cpp tree llama_bin was built in (<tree>/build/bin)."""
    for parent in llama_bin.resolve().parents:
        script = parent / "convert_hf_to_gguf.py"
        if script.is_file():
            return script
    return None


def can_build(llama_bin: Path) -> bool:
    return (llama_bin / "llama-quantize").exists() and converter_script(llama_bin) is not None


def random_q4_0(model: RandomModel, llama_bin: Path, folder: Path | None = None) -> Path:
    """The cached Q4_0 GGUF of `model`, built first if absent (llama_bin: llama-quantize's
    folder)."""
    folder = folder or cache_folder()
    name = model.file_name
    target = folder / name
    if target.is_file():
        return target
    script = converter_script(llama_bin)
    if script is None or not (llama_bin / "llama-quantize").exists():
        raise FileNotFoundError(
            f"{llama_bin}: no llama-quantize, or no convert_hf_to_gguf.py above it"
        )
    work = folder / f"{name}.build"
    shutil.rmtree(work, ignore_errors=True)
    hf = work / "hf"
    try:
        write_hf_folder(model, hf)
        f16 = work / "model-f16.gguf"
        convert = [sys.executable, "-c", _CONVERT, str(script), str(hf)]
        convert += ["--outtype", "f16", "--outfile", str(f16)]
        subprocess.run(convert, check=True, capture_output=True, text=True)
        shutil.rmtree(hf)  # ~2 GB: gone before the quantized copy is written
        partial = work / name
        quantize = [str(llama_bin / "llama-quantize"), str(f16), str(partial), "Q4_0"]
        subprocess.run(quantize, check=True, capture_output=True, text=True)
        partial.replace(target)  # atomic: a half-written file is never taken for the model
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{exc.cmd[:2]} failed:\n{exc.stderr[-3000:]}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def write_hf_folder(model: RandomModel, folder: Path) -> None:
    """config.json, the default model's tokenizer and random f16 weights, in HF's layout."""
    from safetensors.torch import save_file

    from pagedkern.model.gguf_loader import read_gguf_tokenizer
    from pagedkern.model.loading import default_model_path

    tokenizer = read_gguf_tokenizer(default_model_path())
    tokenizer.save(folder)
    # Load it back as a plain fast tokenizer (what the converter's AutoTokenizer must see).
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, ensure_ascii=False))
    vocab = tokenizer.vocab_size
    config = {
        "architectures": [model.architecture],
        "model_type": model.model_type,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "torch_dtype": "float16",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **model.shape,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(_random_weights(model, vocab), str(folder / "model.safetensors"))


def _random_weights(model: RandomModel, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(_SEED)
    shape = model.shape
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q = shape["num_attention_heads"] * d
    kv = shape["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * _STD).to(torch.float16)

    weights = {"model.embed_tokens.weight": normal(vocab, h)}
    weights["model.norm.weight"] = torch.ones(h, dtype=torch.float16)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        weights[p + "self_attn.q_proj.weight"] = normal(q, h)
        weights[p + "self_attn.k_proj.weight"] = normal(kv, h)
        weights[p + "self_attn.v_proj.weight"] = normal(kv, h)
        weights[p + "self_attn.o_proj.weight"] = normal(h, q)
        experts = shape.get("num_experts", 0)
        if experts:  # every layer a mixture of experts (decoder_sparse_step 1)
            moe = shape["moe_intermediate_size"]
            weights[p + "mlp.gate.weight"] = normal(experts, h)
            for e in range(experts):
                for name, rows, cols in (("gate", moe, h), ("up", moe, h), ("down", h, moe)):
                    weights[f"{p}mlp.experts.{e}.{name}_proj.weight"] = normal(rows, cols)
        else:
            weights[p + "mlp.gate_proj.weight"] = normal(inter, h)
            weights[p + "mlp.up_proj.weight"] = normal(inter, h)
            weights[p + "mlp.down_proj.weight"] = normal(h, inter)
        if model.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.float16)
            weights[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.float16)
    return weights


if __name__ == "__main__":  # python bench/random_gguf.py $LLAMA_CPP_BIN [name]: build one alone
    print(random_q4_0(MODELS[sys.argv[2] if len(sys.argv) > 2 else "llama-1b"], Path(sys.argv[1])))
