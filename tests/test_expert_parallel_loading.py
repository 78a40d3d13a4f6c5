"""Each expert-parallel rank reads only its experts: load_model(shard=TensorShard(r, N, True)) of an
HF folder (per-expert safetensors tensors; gpt-oss's stacks and their MXFP4 blocks sliced along
the experts) and of a GGUF file (ffn_*_exps cut along the expert dim before conversion, Q8_0
experts kept int8 in their packed form) equals the whole model cut by
shard_weights(expert_parallel=True), tensor for tensor; another rank's expert tensors are never
read. The uneven split (expert_range) and the token split (token_slice) by their rules."""

from __future__ import annotations

import gguf
import pytest
import torch
from test_model_moe import ARCHITECTURES, COMMON, _save

from pagedkern.model import load_model
from pagedkern.model.tensor_shard import TensorShard, expert_range
from pagedkern.model.weight_shards import shard_weights
from pagedkern.parallel.expert_parallel import token_slice

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


def test_experts_split_as_vllm_places_them():
    # E // N each, the first E % N ranks one more, contiguous
    assert [expert_range(5, r, 2) for r in range(2)] == [range(0, 3), range(3, 5)]
    assert [expert_range(7, r, 3) for r in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [expert_range(128, r, 4).start for r in range(4)] == [0, 32, 64, 96]
    for e, n in [(5, 2), (7, 3), (6, 6), (9, 4)]:
        ranges = [expert_range(e, r, n) for r in range(n)]
        assert [i for r in ranges for i in r] == list(range(e))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_tokens_split_into_contiguous_slices():
    assert [token_slice(5, r, 2) for r in range(2)] == [slice(0, 3), slice(3, 5)]
    assert [token_slice(1, r, 2) for r in range(2)] == [slice(0, 1), slice(1, 1)]  # one owns none
    rows = [i for r in range(3) for i in range(10)[token_slice(10, r, 3)]]
    assert rows == list(range(10))


def assert_loads_as_cut(path, size: int, only: str = "", **kwargs) -> None:
    """Every rank's load equals the whole model cut for it (values: of the weights whose names
    contain `only`; shapes: all)."""
    whole, _ = load_model(path, "cpu", torch.float32, use_cache=False, **kwargs)
    for rank in range(size):
        shard = TensorShard(rank, size, expert_parallel=True)
        model, _ = load_model(path, "cpu", torch.float32, shard=shard, **kwargs)
        assert model.local == shard.config(whole.config)
        assert model.local.moe_intermediate_size == whole.config.moe_intermediate_size
        want = shard_weights(whole.weights, whole.config, rank, size, True).state_dict()
        got = model.weights.state_dict()
        assert got.keys() == want.keys()
        for name, t in got.items():
            assert t.shape == want[name].shape, name
            assert only not in name or torch.equal(t, want[name]), name
        moe = [w for w in model.weights.layers if w.router is not None]
        ids = expert_range(whole.config.num_experts, rank, size)
        assert moe and all(w.experts_down.shape[0] == len(ids) for w in moe)


class _Spy:
    def __init__(self, handle, read: list[str]):
        self.handle, self.read = handle, read

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        self.read.append(key)
        return self.handle.get_tensor(key)

    def get_slice(self, key):
        self.read.append(key)
        return self.handle.get_slice(key)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_hf_rank_reads_only_its_experts(tmp_path, monkeypatch, arch):
    # Mixtral: 5 experts (3 / 2) under its own names (w1 / w3 / w2); Qwen2-MoE: 4, and a shared
    # expert cut along its intermediate size as under tensor parallelism
    make_config, model_class = ARCHITECTURES[arch]
    _save(tmp_path, make_config, model_class)
    assert_loads_as_cut(str(tmp_path), 2)
    import pagedkern.model.hf_loader as hf_loader

    read: list[str] = []
    real = hf_loader.safe_open
    monkeypatch.setattr(hf_loader, "safe_open", lambda *a, **k: _Spy(real(*a, **k), read))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32, shard=TensorShard(1, 2, True))
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == set(expert_range(model.config.num_experts, 1, 2))


def _qwen3_moe_q8():
    # K of every expert matrix a multiple of 32 (Q8_0 blocks, int8); 5 experts (3 / 2)
    return transformers.Qwen3MoeConfig(
        head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=5,
        num_experts_per_tok=2, norm_topk_prob=True, **COMMON,
    )  # fmt: skip


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_gguf_rank_cuts_its_experts_out_of_the_stacks(tmp_path, monkeypatch, quantization):
    # int8: the Q8_0 experts kept in their packed form, rows of blocks of the rank's experts
    from test_model_moe_gguf import write_moe_gguf

    hf = _save(tmp_path / "hf", _qwen3_moe_q8, "Qwen3MoeForCausalLM")
    path = tmp_path / "m.gguf"
    write_moe_gguf(path, hf, "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    # (int8 row-parallel parts of the F32 attention get row scales of their own: experts only)
    assert_loads_as_cut(
        path, 2, "experts" if quantization == "int8" else "", quantization=quantization
    )
    model, _ = load_model(path, "cpu", torch.float32, quantization=quantization,
                          shard=TensorShard(1, 2, True))  # fmt: skip
    experts = model.weights.layers[0].experts_gate_up
    assert tuple(experts.shape) == (2, 128, 64)
    assert (quantization == "int8") == (getattr(experts, "format", None) == "int8")


def test_an_int4_rank_holds_its_experts_quantized(tmp_path):
    # an HF folder quantized at load: each expert's groups are its own, so the cut is exact
    _save(tmp_path, _qwen3_moe_q8, "Qwen3MoeForCausalLM")
    assert_loads_as_cut(str(tmp_path), 2, quantization="int4")


@pytest.mark.parametrize("kind", ["mxfp4_folder", "mxfp4_gguf"])
def test_a_gpt_oss_rank_reads_its_experts_and_their_biases(tmp_path, kind):
    # stacked [E, ...] tensors and their biases along dim 0 (MXFP4: its blocks' experts only)
    from mxfp4_quantizer import quantize_mxfp4
    from safetensors.torch import load_file, save_file
    from test_model_gguf_gpt_oss import MXFP4, ROPE, _llama_cpp_experts, write_gpt_oss_gguf
    from test_model_gpt_oss import save

    hf = save(tmp_path, _llama_cpp_experts, swiglu_limit=7.0, rope_parameters=ROPE)
    path = tmp_path / "m.gguf"
    if kind == "mxfp4_gguf":
        write_gpt_oss_gguf(path, hf, MXFP4)
    else:
        path = tmp_path
        tensors = load_file(str(tmp_path / "model.safetensors"))
        for name in [n for n in tensors if n.endswith(("gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert_loads_as_cut(str(path), 2, **({"quantization": "none"} if kind.endswith("gguf") else {}))


def test_a_synthetic_model_cut_by_experts():
    # weights made whole (synthetic) and cut: the rank's experts whole, the shared expert and
    # the attention halved, the router whole
    from pagedkern.model import PRESETS

    config = PRESETS["tiny"].replace(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, dense_layers=(1,),
        shared_expert_size=40, norm_topk_prob=False,
    )  # fmt: skip
    whole, _ = load_model(config, "cpu", torch.float32, seed=3)
    model, _ = load_model(config, "cpu", torch.float32, seed=3, shard=TensorShard(1, 2, True))
    for w, part in zip(whole.weights.layers, model.weights.layers, strict=True):
        if w.router is None:  # the dense layer: tensor-parallel
            assert part.gate_up.shape[0] * 2 == w.gate_up.shape[0]
            continue
        assert torch.equal(part.router, w.router)
        assert torch.equal(part.experts_gate_up, w.experts_gate_up[3:5])
        assert torch.equal(part.experts_down, w.experts_down[3:5])
        assert part.down.shape[1] * 2 == w.down.shape[1]  # the shared expert's columns
        assert part.qkv.shape[0] * 2 == w.qkv.shape[0]
