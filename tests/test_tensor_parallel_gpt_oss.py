"""gpt-oss at tensor-parallel size 2 on the CPU (gloo, loopback): TP = 2 gives TP = 1's greedy
tokens and logits (within LOGITS_ATOL) for test_model_gpt_oss's tiny model from its HF folder
and from its GGUF (F32, and MXFP4 experts whose per-rank columns fall inside a 32-block), each
rank reading its part of the checkpoint: its query heads' sinks and q/k/v biases, every
expert's slice of the intermediate size with its gate/up biases, the o and down biases on rank
0 only, the router and its bias whole. A rank's sharded load equals the whole model cut by
shard_weights (an MXFP4 folder's rank reading only the blocks covering its part: rows of
gate_up's, the 32-block holding its 16 columns of down's)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from mxfp4_quantizer import quantize_mxfp4
from safetensors.torch import load_file, save_file
from tensor_parallel_cases import LOGITS_ATOL, SETTINGS, greedy, prompts, record_logits
from test_model_gguf_gpt_oss import MXFP4, ROPE, _llama_cpp_experts, write_gpt_oss_gguf
from test_model_gpt_oss import save

from pagedkern.engine import LLM
from pagedkern.model import load_model
from pagedkern.model.gguf_loader import load_gguf
from pagedkern.model.hf_loader import load_hf_folder
from pagedkern.model.tensor_shard import TensorShard
from pagedkern.parallel import shard_weights

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"folder": HF folder, "mxfp4_folder": the same with MXFP4 experts, "f32": GGUF,
    "mxfp4": GGUF with MXFP4 experts} of one model."""
    root = tmp_path_factory.mktemp("gpt_oss_tp")
    hf = save(root / "hf", _llama_cpp_experts, swiglu_limit=7.0, rope_parameters=ROPE)
    shutil.copytree(root / "hf", root / "hf_mxfp4")
    tensors = load_file(str(root / "hf_mxfp4" / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # rows = outputs
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(root / "hf_mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    write_gpt_oss_gguf(root / "f32.gguf", hf)
    write_gpt_oss_gguf(root / "mxfp4.gguf", hf, MXFP4)
    return {"folder": str(root / "hf"), "mxfp4_folder": str(root / "hf_mxfp4"),
            "f32": str(root / "f32.gguf"), "mxfp4": str(root / "mxfp4.gguf")}  # fmt: skip


@pytest.mark.parametrize("kind", ["folder", "mxfp4"])
def test_tp2_greedy_tokens_and_logits_equal_tp1(checkpoints, kind):
    # one block table for both layer kinds at TP = 1 too (TP > 1 turns per-kind tables off):
    # the same pool, so the same schedule, step for step
    settings = dict(SETTINGS, quantization="none", kv_per_kind_tables=False)
    reference = LLM(checkpoints[kind], **settings)
    ids = prompts(reference.engine.vocab_size)[:6]
    want_logits = record_logits(reference)
    want = reference.generate(ids, greedy(8), use_tqdm=False)
    with LLM(checkpoints[kind], tensor_parallel_size=2, **settings) as parallel:
        local, full = parallel.engine.model.local, reference.engine.model.config
        assert local.num_heads * 2 == full.num_heads
        assert local.moe_intermediate_size * 2 == full.moe_intermediate_size
        got_logits = record_logits(parallel)
        got = parallel.generate(ids, greedy(8), use_tqdm=False)
    assert all(g.error is None for g in got), [g.error for g in got]
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert len(got_logits) == len(want_logits) > len(ids)
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits, strict=True))
    assert worst <= LOGITS_ATOL, worst


@pytest.mark.parametrize("kind", ["folder", "mxfp4_folder", "f32", "mxfp4"])
def test_a_ranks_sharded_load_equals_the_whole_model_cut(checkpoints, kind):
    path = checkpoints[kind]
    whole, _ = load_model(path, "cpu", torch.float32, quantization="none")
    config = whole.config
    for rank in range(2):
        shard = TensorShard(rank, 2)
        if kind.endswith("folder"):
            _, part, _ = load_hf_folder(path, "cpu", torch.float32, shard=shard)
        else:
            _, part, _ = load_gguf(path, "cpu", torch.float32, quantization="none", shard=shard)
        cut = shard_weights(whole.weights, config, rank, 2)
        for n, (got, want, full) in enumerate(
            zip(part.layers, cut.layers, whole.weights.layers, strict=True)
        ):
            for field in dataclasses.fields(got):
                a, b = getattr(got, field.name), getattr(want, field.name)
                assert (a is None) == (b is None), (n, field.name)
                assert a is None or torch.equal(a, b), (n, field.name)
            # the rules, spelled out: sinks by query head, biases with their rows, rank 0's
            heads, i = config.num_heads // 2, config.moe_intermediate_size // 2
            assert torch.equal(got.sinks, full.sinks[rank * heads : (rank + 1) * heads])
            assert got.router is not None and torch.equal(got.router_bias, full.router_bias)
            inter = config.moe_intermediate_size
            gate = full.experts_gate_up_bias[:, rank * i : (rank + 1) * i]
            up = full.experts_gate_up_bias[:, inter + rank * i : inter + (rank + 1) * i]
            assert torch.equal(got.experts_gate_up_bias, torch.cat([gate, up], 1))
            assert (got.experts_down_bias is not None) == (rank == 0)
            assert (got.o_bias is not None) == (rank == 0)
