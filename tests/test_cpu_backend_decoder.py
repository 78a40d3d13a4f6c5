"""The CPU backend's one-call decoder (ops/cpu/decoder.py, csrc/cpu/decoder.cpp) against the
layer loop it replaces (cpu_decoder:layers): the same hidden states and the same KV-cache
writes bit for bit, for int4 and int8 weights, with and without q/k/v and O biases, prefill
chunks, decode rows and both in one step, over several steps; one decoder call a step; the
models, caches and variants it refuses run the loop; and an int4 engine's steps take it."""

from __future__ import annotations

import pytest
import torch

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import PRESETS, SequenceChunk, build_batch, load_model
from pagedkern.ops.cpu import decoder, quant_gemv

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")
BLOCK = 16


@pytest.fixture
def runs(monkeypatch) -> list[int]:
    """The rows of each decoder call."""
    seen: list[int] = []
    real = decoder._run
    monkeypatch.setattr(
        decoder, "_run", lambda d, s, h, r, meta: seen.append(h.shape[0]) or real(d, s, h, r, meta)
    )
    return seen


def _steps(model):
    """Three steps over two sequences: prefills, a decode beside a prefill chunk, decodes."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    a, b = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 70))
    return [
        [SequenceChunk(a, 0, [1, 2, 3])],
        [SequenceChunk([5], 40, [1, 2, 3]), SequenceChunk(b[:50], 0, [4, 5, 6, 7, 8])],
        [SequenceChunk([6], 41, [1, 2, 3]), SequenceChunk(b[50:], 50, [4, 5, 6, 7, 8])],
        [SequenceChunk([7], 42, [1, 2, 3]), SequenceChunk([8], 70, [4, 5, 6, 7, 8])],
    ]


def _run_steps(model, variant: str, kernels) -> tuple[list[torch.Tensor], torch.Tensor]:
    kernels(cpu_decoder=variant)
    kv = model.allocate_kv_cache(12, BLOCK)
    kv.data.fill_(float("nan"))  # never-written slots stay NaN
    with ops.use_backend("cpu"):
        hidden = [model.hidden_states(*build_batch(step, BLOCK), kv) for step in _steps(model)]
    return hidden, kv.data


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("biases", [False, True])
def test_the_decoder_gives_the_layer_loops_bits(quantization, biases, kernels, runs):
    config = PRESETS["tiny"].replace(qkv_bias=biases, o_bias=biases)
    model, _ = load_model(config, quantization=quantization, seed=3)
    got, got_kv = _run_steps(model, "fused", kernels)
    assert runs == [40, 51, 21, 2]  # one call a step, every row
    want, want_kv = _run_steps(model, "layers", kernels)
    assert len(runs) == 4  # the loop made none
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.isnan().any()
        assert torch.equal(g, w), f"step {step}"
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "case",
    ["fp32 weights", "sliding window", "fp8 cache", "tiles attention", "layers variant"],
)
def test_what_it_refuses_runs_the_layer_loop(case, kernels, runs):
    config, quantization, kv_dtype = PRESETS["tiny"], "int4", "auto"
    if case == "fp32 weights":
        quantization = None
    elif case == "sliding window":
        config = config.replace(sliding_window=8, layer_types=("sliding", "full"))
    elif case == "fp8 cache":
        kv_dtype = "fp8"
    elif case == "tiles attention":
        kernels(cpu_attention="tiles")
    elif case == "layers variant":
        kernels(cpu_decoder="layers")
    model, _ = load_model(config, quantization=quantization, kv_cache_dtype=kv_dtype)
    kv = model.allocate_kv_cache(12, BLOCK)
    with ops.use_backend("cpu"):
        h = model.hidden_states(*build_batch(_steps(model)[0], BLOCK), kv)
    assert runs == [] and not h.isnan().any()


def test_an_int4_engine_steps_through_it(runs):
    config = EngineConfig(
        model="synthetic:tiny", backend="cpu", quantization="int4", num_blocks=64, block_size=4
    )
    engine = Engine.from_config(config)
    engine.add_request(prompt_ids=list(range(3, 30)), params=SamplingParams(max_tokens=5))
    list(engine.run_until_done())
    assert runs[0] == 27 and runs[1:] == [1, 1, 1, 1]
