"""Each tensor-parallel rank reads only its part of the checkpoint: load_model(shard=...) of an HF
folder (safetensors slices) and of a GGUF file (slices of the mapped tensors, dequantized after
the cut) equals loading the whole model and cutting it (weight_shards.shard_weights) exactly,
tensor for tensor, for dense and mixture-of-experts models; the tensors a rank reads whole are
only the replicated ones, and it dequantizes about 1/N of the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from hf_model_files import base_config
from tensor_parallel_cases import mqa_folder

from pagedkern.model import load_model
from pagedkern.model.gguf_shard import TensorPart, _cut, narrow_columns
from pagedkern.model.quantized_linear import gguf_to_int4
from pagedkern.model.tensor_shard import Part, TensorShard
from pagedkern.model.weight_shards import cols, shard_weights

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


def assert_loads_as_cut(path, size: int, only: str = "", **kwargs) -> None:
    """Every rank's load equals the whole model cut for that rank, with the rank's shapes (the
    weights whose names contain `only`)."""
    whole, _ = load_model(path, "cpu", torch.float32, use_cache=False, **kwargs)
    for rank in range(size):
        shard = TensorShard(rank, size)
        model, _ = load_model(path, "cpu", torch.float32, shard=shard, **kwargs)
        assert model.local == shard.config(whole.config) and model.config == whole.config
        want = shard_weights(whole.weights, whole.config, rank, size).state_dict()
        got = model.weights.state_dict()
        assert got.keys() == want.keys()
        for name, t in got.items():
            if only not in name:
                continue
            assert t.shape == want[name].shape, name
            assert torch.equal(t, want[name]), name


class _Spy:
    """A safetensors handle recording which tensors are read whole and which as slices."""

    def __init__(self, handle, whole: list[str], sliced: list[str]):
        self.handle, self.whole, self.sliced = handle, whole, sliced

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        self.whole.append(key)
        return self.handle.get_tensor(key)

    def get_slice(self, key):
        self.sliced.append(key)
        return self.handle.get_slice(key)


def _moe_folder(tmp_path, arch: str):
    from test_model_moe import ARCHITECTURES, _save

    make_config, model_class = ARCHITECTURES[arch]
    folder = tmp_path / arch
    return str(folder), _save(folder, make_config, model_class)


@pytest.mark.parametrize("case", ["mqa-tp3", "qwen2_moe-tp2"])
def test_an_hf_rank_reads_only_its_slices(tmp_path, monkeypatch, case):
    if case == "mqa-tp3":  # biases, one KV head replicated, vocabulary 400 in 134/134/132
        folder, size = mqa_folder(tmp_path / "mqa"), 3
    else:  # every expert and the shared expert split, router and shared gate whole
        folder, size = _moe_folder(tmp_path, "qwen2_moe")[0], 2
    assert_loads_as_cut(folder, size)
    import pagedkern.model.hf_loader as hf_loader

    whole, sliced = [], []
    real = hf_loader.safe_open
    monkeypatch.setattr(hf_loader, "safe_open", lambda *a, **k: _Spy(real(*a, **k), whole, sliced))
    model, _ = load_model(folder, "cpu", torch.float32, shard=TensorShard(1, size))
    shard = TensorShard(1, size)
    assert sliced and all(shard.part(model.config, n) is not None for n in sliced)
    assert all(shard.part(model.config, n) is None for n in whole)
    assert not any(n.endswith(("o_proj.bias", "down_proj.bias")) for n in whole + sliced)
    assert any("experts" in n or "q_proj" in n for n in sliced)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_gguf_rank_dequantizes_only_its_slices(tmp_path, monkeypatch, quantization):
    """A llama GGUF (Q8_0 matrices, Q/K permuted for llama.cpp's RoPE: each rank unpermutes its
    own heads), whole-rows and whole-block column parts."""
    from test_model_gguf import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, base_config(intermediate_size=128))
    assert_loads_as_cut(path, 2, quantization=quantization)
    import gguf.quants

    seen: list[int] = []
    real = gguf.quants.dequantize

    def counting(data, kind):
        seen.append(data.size)
        return real(data, kind)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    load_model(path, "cpu", torch.float32, quantization="none", use_cache=False)
    whole, seen[:] = sum(seen), []
    load_model(path, "cpu", torch.float32, quantization="none", shard=TensorShard(0, 2))
    assert 0 < sum(seen) < 0.6 * whole  # half of every matrix, and the norms whole


@pytest.mark.parametrize("kind, dtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_a_16_bit_gguf_rank_keeps_its_parts_16_bit(tmp_path, kind, dtype):
    from test_model_gguf import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, base_config(intermediate_size=128), matrices=gguf.GGMLQuantizationType[kind])
    assert_loads_as_cut(path, 2)
    model, _ = load_model(path, "cpu", torch.float32, shard=TensorShard(1, 2))
    layer = model.weights.layers[0]
    assert {layer.qkv.dtype, layer.o.dtype, layer.down.dtype} == {dtype}


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_a_moe_gguf_rank_reads_its_part_of_every_expert(tmp_path, arch):
    from test_model_moe_gguf import GGUF_ARCH, write_moe_gguf

    _, hf = _moe_folder(tmp_path, arch)
    path = tmp_path / "m.gguf"
    write_moe_gguf(path, hf, GGUF_ARCH[arch], gguf.GGMLQuantizationType.Q8_0)
    assert_loads_as_cut(path, 2, quantization="none")


def test_a_column_part_inside_q4_k_blocks_reads_the_covering_blocks():
    """Q4_K blocks hold 256 columns: columns [384, 768) of a 768-wide row (Qwen3-30B-A3B's
    experts' down projection at TP = 2) are read as blocks [256, 768) and narrowed after the
    conversion, to floats or to int4 (G = 32), equal to cutting the whole tensor."""
    from test_quant_gemm import _q4k_blocks

    rows, k = 8, 768
    kind = gguf.GGMLQuantizationType.Q4_K
    raw = _q4k_blocks(np.random.default_rng(0), rows, k)  # (gguf has no Q4_K quantizer)
    tensor = TensorPart("w", kind, (k, rows), raw)
    tensors = {"w": tensor}
    offset, width = _cut(tensors, "w", Part(1, 384, 768, k))
    part = tensors["w"]
    assert (offset, width) == (128, 384) and part.shape == (512, rows)
    assert part.data.shape == (rows, raw.shape[1] * 2 // 3)  # 2 of 3 blocks per row read
    floats = torch.from_numpy(dequantize(part.data, kind))
    want = torch.from_numpy(dequantize(raw, kind))[:, 384:]
    assert torch.equal(narrow_columns(floats, offset, width, "w"), want)
    int4 = narrow_columns(gguf_to_int4("Q4_K", part.data, rows, 512), offset, width, "w")
    want4 = cols(gguf_to_int4("Q4_K", raw, rows, k), 384, 768, "w")
    assert torch.equal(int4.dequantize_rows(), want4.dequantize_rows())
    # rows: whole rows, no narrowing
    tensors = {"w": tensor}
    assert _cut(tensors, "w", Part(0, 4, 8, rows)) is None
    assert np.array_equal(tensors["w"].data, raw[4:8])


def test_quantized_experts_are_cut_in_their_packed_form(tmp_path):
    """Q8_0 experts kept int8 with their block scales (stacked [E, N, K]): each rank's rows of
    gate/up equal the whole int8 experts cut; down's columns are whole Q8_0 blocks, so its
    values and scales are the whole experts' columns exactly."""
    from test_model_moe import COMMON, _save
    from test_model_moe_gguf import write_moe_gguf

    def config():  # experts of 64: K % 32 for int8 on both GEMMs, whole and cut
        return transformers.Qwen3MoeConfig(
            head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, **COMMON,
        )  # fmt: skip

    hf = _save(tmp_path / "hf", config, "Qwen3MoeForCausalLM")
    path = tmp_path / "m.gguf"
    write_moe_gguf(path, hf, "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    assert_loads_as_cut(path, 2, only="experts_gate_up", quantization="int8")
    whole, _ = load_model(path, "cpu", torch.float32, quantization="int8", use_cache=False)
    model, _ = load_model(path, "cpu", torch.float32, quantization="int8", shard=TensorShard(1, 2))
    down, want = model.weights.layers[0].experts_down, whole.weights.layers[0].experts_down
    assert (down.format, down.group_size) == ("int8", 32) and tuple(down.shape) == (4, 64, 32)
    assert torch.equal(down.dequantize_rows(), want.dequantize_rows()[..., 32:])
