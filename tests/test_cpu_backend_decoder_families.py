"""The one-call CPU decoder on the dense families as transformers builds them: tiny random
Qwen3, Gemma 2 and Gemma 3 models saved by transformers with weights on the int8 grid, loaded
with int8 weights. The prefill's logits through the decoder are transformers' own (within the
C++ GEMV's 16-bit activations), and an
engine's greedy steps on the CPU backend (chunked prefill, two requests, Gemma's per-kind block
tables) give the layer loop's tokens and logprobs exactly."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import all_logits, write_tokenizer
from transformers_oracle import hf_logits, relative

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import load_model
from pagedkern.ops.cpu import decoder, quant_gemv

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")

PROMPT = [5, 77, 301, 12, 250, 9, 33, 120, 64, 7, 199, 3, 42, 318, 91, 17, 260, 88, 2, 150]
COMMON = dict(
    vocab_size=400,  # the tokenizer write_tokenizer trains
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
)
GEMMA = dict(sliding_window=6, query_pre_attn_scalar=24)
LOCAL_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
FAMILIES = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(rope_theta=1e6, **COMMON)
    ),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            attn_logit_softcapping=2.0, final_logit_softcapping=5.0, **GEMMA, **COMMON
        )
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            rope_parameters=LOCAL_ROPE, sliding_window_pattern=3, **GEMMA, **COMMON
        )
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = FAMILIES[request.param]().float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and request.param.startswith("gemma"):
                p.normal_(0.0, 0.3)  # (transformers starts Gemma's norms at a scale of 1)
            elif p.ndim == 2 and "embed_tokens" not in name:  # onto the int8 grid
                scale = p.abs().amax(dim=1, keepdim=True) / 127.0
                p.copy_(torch.round(p / scale) * scale)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder, hf, request.param


@pytest.fixture
def runs(monkeypatch) -> list[int]:
    """The rows of each decoder call."""
    seen: list[int] = []
    real = decoder._run
    monkeypatch.setattr(decoder, "_run", lambda *a: seen.append(a[-3].shape[0]) or real(*a))
    return seen


def test_the_prefill_through_the_decoder_gives_transformers_logits(saved, runs):
    """The weights lie on the per-channel int8 grid (scale max|w| / 127: quantize_int8's), so
    transformers in fp32 computes the int8 model exactly; only the C++ GEMV's 16-bit
    activations (~2e-5 a GEMM) stand between the two."""
    folder, hf, _ = saved
    model, _ = load_model(str(folder), "cpu", torch.float32, quantization="int8")
    assert model.weights.layers[0].qkv.format == "int8"
    got = all_logits(model, PROMPT)
    assert runs == [len(PROMPT)]  # the whole prompt in one decoder call
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


def test_an_engines_steps_through_the_decoder_give_the_loops_tokens(saved, runs, kernels):
    folder, _, family = saved
    kernels(cpu_decoder="fused")
    fused = _greedy(folder, family)
    assert len(runs) > 12 and 2 in runs  # chunked prefill steps, then two decode rows a step
    kernels(cpu_decoder="layers")
    made = len(runs)
    assert _greedy(folder, family) == fused
    assert len(runs) == made  # the loop made no decoder call
    assert all(len(tokens) == 12 for tokens in fused)
