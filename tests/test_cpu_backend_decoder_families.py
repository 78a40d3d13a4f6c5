"""The one-call CPU decoder on the dense families as transformers builds them: the tiny random
Qwen3, Gemma 2 and Gemma 3 test models, their weights moved onto the int8 grid, saved by
transformers and loaded with int8 weights. The prefill's logits through the decoder are
transformers' own (within the C++ GEMV's 16-bit activations), and an engine's greedy steps on
the CPU backend (chunked prefill, two requests, Gemma's per-kind block tables) give the layer
loop's tokens and logprobs exactly."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import all_logits, write_tokenizer
from test_model_gemma import PROMPT
from test_model_gemma import _hf_model as gemma_model
from test_model_transformers import ARCHITECTURES as DENSE
from transformers_oracle import hf_logits, relative

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import load_model
from pagedkern.ops.cpu import quant_gemv

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")

FAMILIES = ("gemma2", "gemma3", "qwen3")


def _transformers_model(family: str):
    """The test models of test_model_gemma / test_model_transformers (fp32, eval mode)."""
    if family == "qwen3":
        make_config, model_class = DENSE["qwen3"]
        torch.manual_seed(0)
        return model_class(make_config()).float().eval()
    return gemma_model(family)


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    hf = _transformers_model(request.param)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:  # onto the int8 grid (a tied embedding is the int8 head)
                scale = (p.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
                p.copy_(torch.round(p / scale) * scale)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder, hf, request.param


def test_the_prefill_through_the_decoder_gives_transformers_logits(saved, decoder_runs):
    """The weights lie on the per-channel int8 grid (scale max|w| / 127: quantize_int8's), so
    transformers in fp32 computes the int8 model exactly; only the C++ GEMV's 16-bit
    activations (~2e-5 a GEMM) stand between the two."""
    folder, hf, _ = saved
    model, _ = load_model(str(folder), "cpu", torch.float32, quantization="int8")
    assert model.weights.layers[0].qkv.format == "int8"
    got = all_logits(model, PROMPT)
    assert decoder_runs == [len(PROMPT)]  # the whole prompt in one decoder call
    want = hf_logits(hf, PROMPT)
    assert relative(got, want) < 1e-3, relative(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _greedy(folder, family: str) -> list:
    engine = Engine.from_config(
        EngineConfig(
            model=str(folder), backend="cpu", quantization="int8", num_blocks=96, block_size=4,
            max_num_batched_tokens=8,
        )
    )  # fmt: skip
    assert (engine.kv_cache.groups is not None) == family.startswith("gemma")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    requests = [engine.add_request(prompt_ids=p, params=params) for p in (PROMPT, PROMPT[5:])]
    got: dict[str, list] = {r.request_id: [] for r in requests}
    for output in engine.run_until_done():
        got[output.request_id] += [
            (t, lp.logprob) for t, lp in zip(output.token_ids, output.logprobs, strict=True)
        ]
    return [got[r.request_id] for r in requests]


def test_an_engines_steps_through_the_decoder_give_the_loops_tokens(saved, decoder_runs, kernels):
    folder, _, family = saved
    kernels(cpu_decoder="fused")
    fused = _greedy(folder, family)
    assert (
        len(decoder_runs) > 12 and 2 in decoder_runs
    )  # chunked prefill steps, then two decode rows a step
    kernels(cpu_decoder="layers")
    made = len(decoder_runs)
    assert _greedy(folder, family) == fused
    assert len(decoder_runs) == made  # the loop made no decoder call
    assert all(len(tokens) == 12 for tokens in fused)
