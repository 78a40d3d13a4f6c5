"""Shadow mode over mixture-of-experts layers (ops/shadow.py): every fused_moe call is compared
with the reference (float experts) or the float MLP over the dequantized experts (quantized
experts), and its routing on its own as "moe_route"; an injected fault in one layer's experts
or router is named by step, layer and op."""

from __future__ import annotations

import functools

import pytest
import torch
from test_model_moe import ARCHITECTURES, _save
from test_model_moe_quantized import Q, _gguf

import pagedkern.ops as ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams, ShadowDivergence
from pagedkern.ops import moe

pytest.importorskip("transformers")

PROMPT = list(range(3, 30))
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A Qwen2-MoE folder: 3 MoE layers, each with a shared expert. (Not Qwen3-MoE: shadow
    mode's rope_and_cache reference leaves QK-norm out, so it flags every Qwen3 layer.)"""
    folder = tmp_path_factory.mktemp("qwen2_moe")
    _save(folder, *ARCHITECTURES["qwen2_moe"])
    return folder


def _engine(model, shadow="on", **overrides) -> Engine:
    config = dict(model=str(model), backend="reference", num_blocks=64, block_size=4,
                  shadow=shadow, **overrides)  # fmt: skip
    return Engine.from_config(EngineConfig(**config))


def _run(engine) -> list[int]:
    engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    return [t for out in engine.run_until_done() for t in out.token_ids]


def _faulty_moe(monkeypatch, target, from_step, engine, scale=1.1):
    """ops.fused_moe, with its output scaled in the layer whose experts are `target`."""
    real = ops.fused_moe

    @functools.wraps(real)
    def op(*args, **kwargs):
        result = real(*args, **kwargs)
        if args[2] is target and engine.iteration >= from_step:
            result.mul_(scale)
        return result

    monkeypatch.setattr(ops, "fused_moe", op)


def test_moe_layers_are_checked_and_a_correct_run_diverges_nowhere(qwen2_moe):
    engine = _engine(qwen2_moe)
    _run(engine)
    report = engine.shadow
    assert report.first is None
    for op in ("fused_moe", "moe_route"):
        assert {layer for o, layer in report.stats if o == op} == {0, 1, 2}
        assert report.stats[(op, 2)].calls == 5  # one prefill, four decode steps


def test_a_wrong_expert_output_is_named_by_step_layer_and_op(qwen2_moe, monkeypatch):
    engine = _engine(qwen2_moe)
    _faulty_moe(monkeypatch, engine.model.weights.layers[2].experts_gate_up, 3, engine)
    _run(engine)
    first = engine.shadow.first
    assert (first.step, first.layer, first.op) == (3, 2, "fused_moe")
    assert "step 3, layer 2, fused_moe" in engine.shadow.summary()
    stats = engine.shadow.stats
    assert stats[("fused_moe", 0)].divergences == 0 and stats[("moe_route", 2)].divergences == 0


def test_a_wrong_routing_is_named_moe_route(qwen2_moe, monkeypatch):
    engine = _engine(qwen2_moe, shadow="strict")
    real = moe.moe_route

    def swapped(logits, top_k, **kwargs):  # the right weights on the wrong experts
        weights, ids = real(logits, top_k, **kwargs)
        return weights, (ids + 1) % logits.shape[1]

    monkeypatch.setattr(moe, "moe_route", swapped)
    engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    with pytest.raises(ShadowDivergence, match="step 1, layer 0, moe_route"):
        engine.step()


def test_quantized_experts_are_checked_against_the_dequantized_mlp(tmp_path, monkeypatch):
    path, _ = _gguf(tmp_path, "qwen2moe", Q.Q4_0)
    engine = _engine(path, quantization="int4")
    layer = engine.model.weights.layers[0]
    assert layer.experts_gate_up.format == "int4"
    _run(engine)
    report = engine.shadow
    assert report.first is None, report.summary()  # the CPU int kernels within tolerance
    assert report.stats[("fused_moe", 0)].calls == 5
    engine = _engine(path, quantization="int4")
    _faulty_moe(monkeypatch, engine.model.weights.layers[0].experts_gate_up, 2, engine, 1.2)
    _run(engine)
    first = engine.shadow.first
    assert (first.step, first.layer, first.op) == (2, 0, "fused_moe")
    assert torch.isfinite(torch.tensor(first.error)) and first.error > first.tolerance
