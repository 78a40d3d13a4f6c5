"""Mixture-of-experts GGUF files, written here the way llama.cpp's converter writes each
architecture (Mixtral as "llama" with expert_count, "qwen3moe", "olmoe", "qwen2moe": the router
ffn_gate_inp, the stacked experts ffn_gate_exps / ffn_up_exps / ffn_down_exps, Qwen2-MoE's
shared expert *_shexp and its gate ffn_gate_inp_shexp), load equal to the same model's HF folder
(weights and logits) and give transformers' logits; Q8_0 experts are dequantized at load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from gguf_q4_k import quantize_q4_k
from hf_model_files import all_logits, finish_gguf, gguf_writer_like_llama_cpp
from test_model_gguf import llama_cpp_permute, llama_cpp_tensor_name
from test_model_moe import ARCHITECTURES, _save
from test_model_transformers import PROMPT
from transformers_oracle import relative

from pagedkern.model import load_model
from pagedkern.model.gguf_loader import gguf_default_quantization

transformers = pytest.importorskip("transformers")

# test_model_moe's architectures -> llama.cpp's GGUF arch name
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe"}
# what llama.cpp's graph does for an arch whose file has no expert_weights_norm
LLAMA_CPP_NORM = {"llama": True, "qwen3moe": True, "olmoe": False, "qwen2moe": False}
_MOE_TENSORS = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def write_moe_gguf(path, hf, arch: str, expert_type=None, dense_type=None, down_type=None) -> None:
    """The MoE model as llama.cpp's converter writes it, in F32 (experts whose rows are whole
    32-blocks in `expert_type` if given; so the layers' other matrices in `dense_type`, but the
    router, as llama.cpp keeps it; the experts' down projections in `down_type` if given, as
    llama.cpp's Q4_K_M puts them in Q6_K): write_gguf_like_llama_cpp's metadata and dense tensors,
    plus the expert metadata and the MoE tensors under their GGUF names, the experts stacked
    [E, out, in]."""
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf_writer_like_llama_cpp(path, cfg, arch, head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_local_experts if arch == "llama" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    norm = True if arch == "llama" else cfg.norm_topk_prob
    if norm != LLAMA_CPP_NORM[arch]:
        w.add_expert_weights_norm(norm)
    for name, t in hf.state_dict().items():
        arr = np.ascontiguousarray(t.detach().float().numpy())
        moe = _moe_tensor(name, arr)
        if moe is None:
            if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                arr = llama_cpp_permute(arr, heads)
            if dense_type is not None and name.startswith("model.layers.") and _blocks(arr):
                w.add_tensor(llama_cpp_tensor_name(name), quantize(arr, dense_type),
                             raw_dtype=dense_type)  # fmt: skip
                continue
            w.add_tensor(llama_cpp_tensor_name(name), arr)
            continue
        for gname, part in moe.items():
            kind = down_type if "ffn_down_exps" in gname and down_type else expert_type
            if "_exps." in gname and kind is not None and part.shape[-1] % 32 == 0:
                w.add_tensor(gname, quantized(part, kind), raw_dtype=kind)
            elif dense_type is not None and "_shexp." in gname and _blocks(part):
                w.add_tensor(gname, quantize(part, dense_type), raw_dtype=dense_type)
            else:
                w.add_tensor(gname, part)
    finish_gguf(w)


def quantized(arr: np.ndarray, kind) -> np.ndarray:
    """arr's GGUF bytes in `kind` (Q4_K by tests/gguf_q4_k.py: gguf has no Q4_K quantizer)."""
    if kind != gguf.GGMLQuantizationType.Q4_K:
        return quantize(arr, kind)
    rows = quantize_q4_k(arr.reshape(-1, arr.shape[-1]))
    return rows.reshape(*arr.shape[:-1], rows.shape[-1])


def _blocks(arr: np.ndarray) -> bool:
    """A matrix whose rows are whole 32-blocks (what llama.cpp quantizes)."""
    return arr.ndim == 2 and arr.shape[-1] % 32 == 0


def _moe_tensor(name: str, arr: np.ndarray) -> dict[str, np.ndarray] | None:
    """{GGUF name: array} of a MoE tensor of transformers' state dict, None for a dense one."""
    _, _, layer, rest = name.split(".", 3) if name.startswith("model.layers.") else (0, 0, 0, "")
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
        inter = arr.shape[1] // 2
        return {
            f"blk.{layer}.ffn_gate_exps.weight": np.ascontiguousarray(arr[:, :inter]),
            f"blk.{layer}.ffn_up_exps.weight": np.ascontiguousarray(arr[:, inter:]),
        }
    if rest == "mlp.experts.down_proj":
        return {f"blk.{layer}.ffn_down_exps.weight": arr}
    if rest == "mlp.shared_expert_gate.weight":  # (older converters' vector [H]; both load)
        return {f"blk.{layer}.ffn_gate_inp_shexp.weight": arr.reshape(-1)}
    if rest in _MOE_TENSORS:
        return {f"blk.{layer}.{_MOE_TENSORS[rest]}": arr}
    return None


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_moe_gguf_loads_equal_to_the_hf_folder(tmp_path, arch):
    make_config, model_class = ARCHITECTURES[arch]
    folder = tmp_path / "hf"
    hf = _save(folder, make_config, model_class)
    path = tmp_path / "m.gguf"
    write_moe_gguf(path, hf, GGUF_ARCH[arch])
    assert gguf_default_quantization(path) == "none"
    from_gguf, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization=None
    )
    from_hf, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    assert from_gguf.config.num_experts == from_hf.config.num_experts
    for field in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "dense_layers", "shared_expert_size", "qk_norm_whole"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(from_hf.config, field), field
    for got, want in zip(from_gguf.weights.layers, from_hf.weights.layers, strict=True):
        for field in ("router", "experts_gate_up", "experts_down", "shared_gate", "gate_up"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), field
    got = all_logits(from_gguf, PROMPT).double()
    assert relative(got, all_logits(from_hf, PROMPT).double()) < 1e-6
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].double()
    assert relative(got, want) < 1e-5


def test_q8_0_experts_are_dequantized_at_load(tmp_path):
    make_config, model_class = ARCHITECTURES["qwen3_moe"]
    hf = _save(tmp_path / "hf", make_config, model_class)
    path = tmp_path / "q8.gguf"
    write_moe_gguf(path, hf, "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    assert gguf_default_quantization(path) == "none"  # experts cannot stay quantized yet
    model, _ = load_model(str(path), "cpu", torch.float32, quantization=None)
    layer = model.weights.layers[0]
    assert layer.experts_gate_up.dtype == torch.float32
    stacked = hf.model.layers[0].mlp.experts.gate_up_proj.detach()
    error = relative(layer.experts_gate_up.double(), stacked.double())
    assert 0 < error < 1e-2  # Q8_0's rounding, not a layout error
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].double()
    assert relative(all_logits(model, PROMPT).double(), want) < 3e-2
