"""A bf16 / fp16 HF checkpoint on the CPU backend: its dense layers' projections, embedding and
LM head stay 16-bit in memory (half the bytes and weight reads of the fp32 copy) while the model
computes in fp32, each weight widened exactly inside the fixed-order GEMM (csrc/cpu/
dense_gemm.cpp). So its logits, greedy tokens and logprobs are bit for bit those of the same
values stored as fp32, on the CPU backend and on the reference ops (which widen the weight for
torch's GEMM)."""

from __future__ import annotations

import pytest
import torch
from hf_model_files import all_logits, write_tokenizer
from test_model_transformers import ARCHITECTURES, PROMPT

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import load_model
from pagedkern.ops.cpu import quant_gemv

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")


@pytest.fixture(
    scope="module", params=[("qwen3", torch.bfloat16, False), ("llama", torch.float16, True)]
)
def folders(request, tmp_path_factory):
    """(16-bit folder, fp32 folder of the same values, the 16-bit dtype); Llama's embedding
    tied to its head."""
    family, dtype, tied = request.param
    make_config, model_class = ARCHITECTURES[family]
    config = make_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    hf = model_class(config).to(dtype).eval()
    half, full = (tmp_path_factory.mktemp(f"{family}-{n}") for n in ("half", "full"))
    hf.save_pretrained(half, safe_serialization=True)
    hf.float().save_pretrained(full, safe_serialization=True)  # the same values, fp32
    for folder in (half, full):
        write_tokenizer(folder)
    return half, full, dtype


def test_the_projections_stay_16_bit_and_the_rest_fp32(folders):
    half, _, dtype = folders
    model, _ = load_model(str(half), "cpu")
    layer = model.weights.layers[0]
    assert {layer.qkv.dtype, layer.o.dtype, layer.gate_up.dtype, layer.down.dtype} == {dtype}
    assert model.weights.lm_head.dtype == model.weights.embed.dtype == dtype
    assert model.weights.tied == (model.weights.lm_head is model.weights.embed)
    assert model.weights.norm.dtype == torch.float32
    assert layer.input_norm.dtype == torch.float32


def test_a_quantized_load_and_cuda_dtypes_are_unchanged(folders):
    half, _, _ = folders
    model, _ = load_model(str(half), "cpu", quantization="int8")
    assert model.weights.layers[0].qkv.format == "int8"
    model, _ = load_model(str(half), "cpu", torch.bfloat16)
    assert model.weights.layers[0].qkv.dtype == torch.bfloat16  # (bf16 activations: as asked)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_logits_tokens_and_logprobs_are_the_fp32_copys_bits(folders, backend):
    half, full, _ = folders
    if backend == "cpu":  # the prefill's logits through the model's own GEMMs
        got = all_logits(load_model(str(half), "cpu")[0], PROMPT)
        want = all_logits(load_model(str(full), "cpu")[0], PROMPT)
        assert torch.equal(got, want)
    runs = []
    for folder in (half, full):
        engine = Engine.from_config(
            EngineConfig(
                model=str(folder), backend=backend, num_blocks=64, block_size=4,
                max_num_batched_tokens=8,
            )
        )  # fmt: skip
        runs.append(sampled(engine, [PROMPT, PROMPT[4:]]))
    assert runs[0] == runs[1]
    assert all(len(r) == 10 for r in runs[0])


def sampled(engine: Engine, prompts: list[list[int]]) -> list[list[tuple]]:
    """Each prompt's 10 sampled (token, logprob, top-2) steps, at temperature 0.8."""
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    got = {r.request_id: [] for r in requests}
    for output in engine.run_until_done():
        got[output.request_id] += [
            (t, lp.logprob, lp.top) for t, lp in zip(output.token_ids, output.logprobs)
        ]
    return [got[r.request_id] for r in requests]
