"""gpt-oss GGUF files, written here as llama.cpp's converter (GptOssModel) writes them: arch
"gpt-oss", the interleaved gate_up_proj split into ffn_gate_exps / ffn_up_exps (biases too),
down_proj transposed into ffn_down_exps, the router ffn_gate_inp with its bias, attn_sinks,
the sliding window and YaRN keys; the experts in F32 or repacked from the checkpoint's MXFP4
into GGML's block_mxfp4 (dequantized at load). The file loads equal to the same model's HF
folder and gives transformers' logits.

llama.cpp hard-codes what the file does not say (gguf_gpt_oss.py), so the test model uses the
same: swiglu_limit 7 (the expert weights scaled up so that the clamps still act) and YaRN's
rounded ramp bounds (truncate true)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_model_files import all_logits, finish_gguf, gguf_writer_like_llama_cpp
from mxfp4_quantizer import quantize_mxfp4, representable
from test_model_gpt_oss import LONG_PROMPT, _config, save
from transformers_oracle import relative

from pagedkern.model import load_model
from pagedkern.model.config import FULL, SLIDING
from pagedkern.model.errors import ModelLoadError
from pagedkern.model.gguf_loader import gguf_default_quantization
from pagedkern.model.llama import LlamaModel

transformers = pytest.importorskip("transformers")

MXFP4 = gguf.GGMLQuantizationType.MXFP4
ROPE = {**_config().rope_parameters, "truncate": True}


def _llama_cpp_experts(hf):
    # experts scaled so that llama.cpp's limit 7 clamps a good share of gate / up values, and
    # rounded onto the MXFP4 grid (so the MXFP4 file holds exactly the float folder's weights)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                p.mul_(6.0)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(representable(p.transpose(1, 2)).transpose(1, 2))


def _block_mxfp4(w: torch.Tensor) -> np.ndarray:
    """w [E, rows, K] as GGML's block_mxfp4 bytes [E, rows, K/32 * 17]: the E8M0 byte, then
    element j in byte j's low nibble and j + 16 in its high one (the checkpoint's quantizer,
    whose bytes pair elements 2j / 2j + 1, repacked as the converter repacks them)."""
    blocks, scales = quantize_mxfp4(w)  # [..., K/32, 16] low nibble = element 2j
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2)  # [..., K/32, 32]
    ggml = codes[..., :16] | (codes[..., 16:] << 4)
    packed = torch.cat([scales.unsqueeze(-1), ggml], -1).flatten(-2)
    return np.ascontiguousarray(packed.numpy().astype(np.uint8))


def write_gpt_oss_gguf(path, hf, experts=None) -> None:
    """The model as convert_hf_to_gguf.py's GptOssModel writes it (F32; experts in MXFP4 if
    experts is MXFP4)."""
    cfg = hf.config
    w = gguf_writer_like_llama_cpp(path, cfg, "gpt-oss", cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    for name, t in hf.state_dict().items():
        t = t.detach().float()
        base, _, kind = name.rpartition(".")
        if name.endswith("sinks"):
            base, kind = name, "weight"
        if "experts." in name:  # gate_up_proj(_bias), down_proj(_bias): no ".weight" suffix
            base, _, proj = name.rpartition(".")
            kind = "bias" if proj.endswith("_bias") else "weight"
            proj = proj.removesuffix("_bias")
            if kind == "weight":
                t = t.transpose(1, 2)  # [E, out, in]
            pieces = {"down_proj": t} if proj == "down_proj" else {}
            if proj == "gate_up_proj":  # interleaved columns: gate 0, up 0, gate 1, ...
                pieces = {"gate_proj": t[:, 0::2], "up_proj": t[:, 1::2]}
            for piece, arr in pieces.items():
                gname = names.get_name(f"{base}.{piece}") + f".{kind}"
                if kind == "weight" and experts == MXFP4:
                    w.add_tensor(gname, _block_mxfp4(arr.contiguous()), raw_dtype=MXFP4)
                else:
                    w.add_tensor(gname, np.ascontiguousarray(arr.numpy()))
            continue
        w.add_tensor(f"{names.get_name(base)}.{kind}", np.ascontiguousarray(t.numpy()))
    finish_gguf(w)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_llama_cpp")
    hf = save(folder, _llama_cpp_experts, swiglu_limit=7.0, rope_parameters=ROPE)
    return folder, hf


def _assert_equal_to_the_folder(path, folder, hf):
    from_gguf, _ = load_model(
        str(path), "cpu", torch.float32, kv_cache_dtype="float32", quantization=None
    )
    from_hf, _ = load_model(str(folder), "cpu", torch.float32, kv_cache_dtype="float32")
    got_cfg, want_cfg = from_gguf.config, from_hf.config
    for field in ("layer_types", "sliding_window", "attn_sinks", "router_bias", "moe_scoring",
                  "expert_bias", "swiglu_limit", "swiglu_alpha", "norm_topk_prob", "qkv_bias",
                  "o_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "rope_scaling", "rope_theta", "dense_layers"):  # fmt: skip
        assert getattr(got_cfg, field) == getattr(want_cfg, field), field
    assert got_cfg.layer_types == (SLIDING, FULL, SLIDING)
    for got, want in zip(from_gguf.weights.layers, from_hf.weights.layers, strict=True):
        for field in ("qkv", "qkv_bias", "o_bias", "post_norm", "sinks", "router", "router_bias",
                      "experts_gate_up", "experts_gate_up_bias", "experts_down",
                      "experts_down_bias"):  # fmt: skip
            a, b = getattr(got, field), getattr(want, field)
            assert a is not None and torch.equal(a, b), field
    got = all_logits(from_gguf, LONG_PROMPT).double()
    assert relative(got, all_logits(from_hf, LONG_PROMPT).double()) < 1e-5
    with torch.no_grad():
        want = hf(torch.tensor([LONG_PROMPT])).logits[0].double()
    assert relative(got, want) < 1e-5, relative(got, want)
    return from_gguf


def test_f32_gguf_loads_equal_to_the_folder_and_transformers(saved, tmp_path):
    folder, hf = saved
    path = tmp_path / "f32.gguf"
    write_gpt_oss_gguf(path, hf)
    _assert_equal_to_the_folder(path, folder, hf)


def test_the_default_mode_ignores_the_experts_f32_biases(tmp_path):
    """A Q8_0 file's 2-D expert biases (F32, as llama.cpp writes gpt-oss's) are not layer
    weights: the file keeps its int8."""
    from gguf.quants import quantize

    path = str(tmp_path / "q8.gguf")
    w = gguf.GGUFWriter(path, "gpt-oss")
    q8 = quantize(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),
                  gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_gate_exps.bias", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_default_quantization(path) == "int8"


def test_mxfp4_experts_are_dequantized_at_load(saved, tmp_path):
    folder, hf = saved
    path = tmp_path / "mxfp4.gguf"
    write_gpt_oss_gguf(path, hf, MXFP4)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == MXFP4 == types["blk.1.ffn_down_exps.weight"]
    assert gguf_default_quantization(path) == "none"
    model = _assert_equal_to_the_folder(path, folder, hf)
    assert model.weights.layers[0].experts_gate_up.dtype == torch.float32


def test_the_clamps_act_and_a_wrong_nibble_order_shows(saved):
    # the tests above can fail: the clamp at 7 changes this model's logits, and GGML's nibbles
    # read in the checkpoint's order (2j, 2j + 1) give other weights
    folder, hf = saved
    model, _ = load_model(str(folder), "cpu", torch.float32)
    base = all_logits(model, LONG_PROMPT).double()
    unclamped = LlamaModel(model.config.replace(swiglu_limit=1e9), model.weights)
    assert relative(all_logits(unclamped, LONG_PROMPT).double(), base) > 1e-3
    gate = hf.model.layers[0].mlp.experts.gate_up_proj.detach().transpose(1, 2)[:, 0::2]
    ggml = torch.from_numpy(_block_mxfp4(gate.contiguous())).unflatten(-1, (-1, 17))
    assert np.array_equal(gguf.quants.dequantize(ggml.flatten(-2).numpy(), MXFP4), gate.numpy())
    blocks, scales = quantize_mxfp4(gate.contiguous())  # the checkpoint's byte order
    wrong = torch.cat([scales.unsqueeze(-1), blocks], -1).flatten(-2)  # written unrepacked
    assert not np.array_equal(gguf.quants.dequantize(wrong.numpy(), MXFP4), gate.numpy())


def test_missing_sliding_window_is_named(saved, tmp_path):
    folder, hf = saved
    path = tmp_path / "no_window.gguf"
    hf.config.sliding_window, window = 0, hf.config.sliding_window
    try:
        write_gpt_oss_gguf(path, hf)
    finally:
        hf.config.sliding_window = window
    with pytest.raises(ModelLoadError, match="sliding_window"):
        load_model(str(path), "cpu", torch.float32, quantization=None)
