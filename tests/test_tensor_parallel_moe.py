"""Tensor parallelism over mixture-of-experts models on the CPU (gloo, loopback): TP = 2 gives
TP = 1's greedy tokens and logits (within LOGITS_ATOL) for test_model_moe's tiny Mixtral,
Qwen3-MoE (a dense layer among the MoE ones) and Qwen2-MoE (the shared expert and its gate),
each rank reading only its part of the checkpoint; every expert's intermediate size is split,
the routers are replicated."""

from __future__ import annotations

import pytest
import torch
from tensor_parallel_cases import LOGITS_ATOL, SETTINGS, greedy, prompts, record_logits
from test_model_moe import ARCHITECTURES, _save

from pagedkern.engine import LLM
from pagedkern.model import load_model
from pagedkern.parallel import TensorParallelConfigError, shard_weights
from pagedkern.parallel.shard import check_tp_size

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def saved(request, tmp_path_factory):
    make_config, model_class = ARCHITECTURES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    _save(folder, make_config, model_class)
    return str(folder)


def test_tp2_greedy_tokens_and_logits_equal_tp1(saved):
    settings = dict(SETTINGS, quantization="none")
    reference = LLM(saved, **settings)
    ids = prompts(reference.engine.vocab_size)[:6]
    want_logits = record_logits(reference)
    want = reference.generate(ids, greedy(8), use_tqdm=False)
    with LLM(saved, tensor_parallel_size=2, **settings) as parallel:
        config = parallel.engine.model.local
        full = reference.engine.model.config
        assert config.moe_intermediate_size * 2 == full.moe_intermediate_size
        assert config.shared_expert_size * 2 == full.shared_expert_size
        got_logits = record_logits(parallel)
        got = parallel.generate(ids, greedy(8), use_tqdm=False)
    assert all(g.error is None for g in got), [g.error for g in got]
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert len(got_logits) == len(want_logits) > len(ids)
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits, strict=True))
    assert worst <= LOGITS_ATOL, worst


def test_expert_shards_are_slices_and_the_router_is_whole(saved):
    model, _ = load_model(saved, "cpu", torch.float32)
    config = model.config
    i, s = config.moe_intermediate_size // 2, config.shared_expert_size // 2
    for rank in range(2):
        shard = shard_weights(model.weights, config, rank, 2)
        for whole, part in zip(model.weights.layers, shard.layers, strict=True):
            if whole.router is None:
                continue
            assert part.router is whole.router and part.shared_gate is whole.shared_gate
            inter = config.moe_intermediate_size
            gate = whole.experts_gate_up[:, rank * i : (rank + 1) * i]
            up = whole.experts_gate_up[:, inter + rank * i : inter + (rank + 1) * i]
            assert torch.equal(part.experts_gate_up, torch.cat([gate, up], dim=1))
            down = whole.experts_down[..., rank * i : (rank + 1) * i]
            assert torch.equal(part.experts_down, down)
            if s:
                assert torch.equal(part.down, whole.down[:, rank * s : (rank + 1) * s])


def test_sizes_the_experts_do_not_divide_are_refused(saved):
    config = load_model(saved, "cpu", torch.float32)[0].config
    odd = config.replace(moe_intermediate_size=config.moe_intermediate_size + 1)
    with pytest.raises(TensorParallelConfigError, match="experts' intermediate size"):
        check_tp_size(odd, 2)
    # OLMoE's QK-norm over the whole projection would need the ranks' sums of squares
    with pytest.raises(TensorParallelConfigError, match="whole projection"):
        check_tp_size(config.replace(qk_norm_whole=True), 2)
