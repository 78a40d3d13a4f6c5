"""The engine's planned attention on a GPU (model/step_attention.py): a forward through plan/run
equals the one-shot ops bit for bit (the same kernels and launch parameters), mixed steps
included; the decode graphs plan each size before capturing, keep the plans frozen and alive,
and a replay after new batches equals the eager one-shot forward of the same batch; the engine
answers the same greedy tokens with either path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.cuda_graphs import DecodeGraphs
from pagedkern.model import layout_batch, load_model
from pagedkern.ops.variants import use_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_batches import mixed_batch  # noqa: E402

pytestmark = pytest.mark.gpu
BLOCK = 16


@pytest.fixture(scope="module")
def model():
    return load_model("synthetic:smollm2-135m", "cuda", torch.bfloat16)[0]


def _cache(model, seed: int = 3):
    kv = model.allocate_kv_cache(512, BLOCK)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g, device="cuda").to(kv.data.dtype))
    return kv


@pytest.mark.parametrize("prefills", [[], [40, 7]])
def test_a_planned_forward_equals_the_one_shot_kernels(model, prefills):
    layout = layout_batch(mixed_batch(2, prefills, 9, BLOCK, 49152, 300), BLOCK)
    planned_kv, one_shot_kv = _cache(model), _cache(model)
    got = model(*layout.upload("cuda"), planned_kv)
    with use_kernels(attention_plan="off"):
        want = model(*layout.upload("cuda"), one_shot_kv)
    assert torch.equal(got, want)
    assert torch.equal(planned_kv.data, one_shot_kv.data)


def test_decode_graph_replays_equal_the_eager_one_shot_forward(model):
    kv = _cache(model)
    graphs = DecodeGraphs(model, kv, max_num_seqs=8, max_model_len=1024)
    graphs.capture()
    for size in graphs.sizes:
        attention = graphs.static_step(size)[2]
        assert attention.frozen and attention.num_plans == 1
        ((_, decode),) = attention._plans.values()
        assert decode._launch is not None, "the graph captured the kernel's run"
    eager_kv = _cache(model)
    eager_kv.data.copy_(kv.data)
    for step in range(3):  # new batches into the same static buffers: no new plan
        layout = layout_batch(mixed_batch(20 + step, [], 3 + step, BLOCK, 49152, 900), BLOCK)
        got = graphs.run(layout).clone()
        with use_kernels(attention_plan="off"):
            padded_ids, padded_meta, _ = graphs.static_step(graphs.bucket(3 + step))
            want = model(padded_ids, padded_meta, eager_kv)[: 3 + step]
        assert torch.equal(got, want)
        assert torch.equal(kv.data, eager_kv.data)


def test_the_engine_answers_alike_either_way():
    base = dict(
        model="synthetic:smollm2-135m", backend="cuda", num_blocks=1024, max_num_seqs=8,
        max_model_len=1024, cuda_graphs=True,
    )  # fmt: skip
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(20 + 9 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = []
    for setting in ("on", "off"):
        with use_kernels(attention_plan=setting):
            engine = Engine.from_config(EngineConfig(**base))
            requests = [engine.add_request(prompt_ids=p, params=greedy) for p in prompts]
            while engine.has_unfinished:
                engine.step()
            outputs.append([r.output_ids for r in requests])
            del engine
    assert outputs[0] == outputs[1]
