"""Piecewise CUDA graphs of mixed steps on the GPU (engine/piecewise_graphs.py): captured replays
give the uncaptured static path's logits and cache writes bit for bit (same kernels, same
shapes), launch only attention and one replay per piece, and stay close to the dynamic eager
forward, whose GEMMs see the step's own row count (cuBLAS may choose another algorithm by M,
so the last bits may differ there); the engine's greedy outputs with piecewise graphs on match
those with them off for nearly all requests, as the decode-graph test requires."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from mixed_batches import mixed_batch

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.piecewise_graphs import PiecewiseGraphs
from pagedkern.model import SequenceChunk, layout_batch, load_model
from pagedkern.ops import launch

pytestmark = pytest.mark.gpu

BLOCK = 16
MODEL = "synthetic:smollm2-135m"


def _mixed_batch(seed: int, prefill_lens: list[int], num_decodes: int) -> list[SequenceChunk]:
    return mixed_batch(seed, prefill_lens, num_decodes, BLOCK, vocab=40000, max_prefix=200)


CASES = [([5, 3], 8), ([9, 2], 6), ([100], 15), ([40, 30, 19], 11), ([200, 150], 40), ([900], 63)]


def test_replays_equal_the_static_path_and_launch_attention_only():
    model, _ = load_model(MODEL, "cuda")
    with ops.use_backend("cuda"):
        kv = model.allocate_kv_cache(1024, BLOCK)
        kv.data.normal_(generator=torch.Generator("cuda").manual_seed(0))
        start = kv.data.clone()
        static = PiecewiseGraphs(model, kv, 64, 1024, max_model_len=2048)
        captured = PiecewiseGraphs(model, kv, 64, 1024, max_model_len=2048)
        captured.capture()
        layers = model.config.num_layers
        for seed, (prefill_lens, decodes) in enumerate(CASES):
            layout = layout_batch(_mixed_batch(seed, prefill_lens, decodes), BLOCK)
            kv.data.copy_(start)
            expected = static.run(layout).clone()
            static_cache = kv.data.clone()
            kv.data.copy_(start)
            eager = model(*layout.upload("cuda"), kv)
            kv.data.copy_(start)
            with launch.count_launches() as counts:
                got = captured.run(layout)
            torch.cuda.synchronize()
            assert not got.isnan().any()
            assert torch.equal(got, expected), (prefill_lens, decodes)
            assert torch.equal(kv.data, static_cache)
            attention = Counter({"rope_and_cache": layers, "flash_prefill": layers})
            attention["paged_attention"] = layers
            assert counts == attention + Counter({"graph_replay": layers + 1})
            cos = torch.nn.functional.cosine_similarity(got, eager, dim=-1)
            assert float(cos.min()) > 0.999, (prefill_lens, decodes)
            agree = (got.argmax(-1) == eager.argmax(-1)).float().mean()
            assert float(agree) >= 0.9, (prefill_lens, decodes)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        engine.pool.check_invariants(engine.scheduler.block_tables())
    assert engine.pool.num_used == 0
    return [r.output_ids for r in requests]


def test_engine_with_piecewise_graphs_equals_eager_mixed_steps():
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randint(5, 600))] for _ in range(16)]
    base = dict(
        model=MODEL, backend="cuda", num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=256
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = Engine.from_config(EngineConfig(**base))  # piecewise by default
    assert engine.runner.piecewise is not None and engine.runner.piecewise._replays
    with_pieces = _run(engine, prompts, params)
    del engine
    eager_engine = Engine.from_config(EngineConfig(**base, piecewise_cuda_graphs=False))
    assert eager_engine.runner.piecewise is None
    eager = _run(eager_engine, prompts, params)
    same = sum(a == b for a, b in zip(with_pieces, eager, strict=True))
    assert same >= len(prompts) - 1
