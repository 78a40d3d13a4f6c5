"""int8's levers toward 90% identical answers (bench/results/2026-12-04-cpu.md): per variant,
the agreement with fp32 on quant_agreement's 32 prompts, greedy, 8 tokens. Not a test and on no
product path: the measurement behind the recorded numbers.

python tests/quant_int8_levers.py head : the int8 model's LM head (and tied embedding) as the
    GGUF's exact Q8_0 values in fp32, rounded to bf16, or int8 with fp32 logits, instead of
    torch's int8 kernel (bf16 logits).
python tests/quant_int8_levers.py gptq : the layers' per-channel int8 weights rounded by GPTQ
    (Frantar et al. 2022; act-order, damping 0.01, the round-to-nearest row scales) instead of
    to nearest, calibrated on the fp32 model's GEMM inputs over CALIBRATION_TEXT and the model's
    own samples for CALIBRATION_SEEDS (none of the test prompts); held-out GEMM output error on
    NLL_TEXT and the test answers; with the int8 or the fp32 head, kernels or fp32 GEMMs.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import fields

import torch
import torch.nn.functional as F
from quant_agreement import (
    NLL_TEXT,
    agreement,
    emulated_linear,
    greedy_answers,
    mean_nll,
    prompt_ids,
    token_logprobs,
)

from pagedkern.engine import LLM, SamplingParams
from pagedkern.model import SequenceChunk, build_batch, llama
from pagedkern.model.quantized_linear import QuantizedWeight
from pagedkern.model.weights import LINEAR_FIELDS, LayerWeights, LlamaWeights

MAX_TOKENS = 8
CALIBRATION_TEXT = """The history of mathematics spans thousands of years, from counting with pebbles to the abstract algebra of the twentieth century. Ancient Babylonian scribes recorded tables of reciprocals on clay tablets, and Greek geometers such as Euclid organised knowledge into axioms and proofs. In medieval Baghdad, scholars translated and extended these works, giving us the word algorithm.
Rivers shape the land they cross. Over centuries a river carves valleys, deposits fertile silt on its floodplain, and builds deltas where it meets the sea. Farmers have settled along rivers since the first cities, because water, transport and rich soil were all close at hand.
import math

def mean_and_std(values):
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return mean, math.sqrt(var)

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()
User: Can you recommend a good book for a long train journey?
Assistant: Sure! If you enjoy adventure, try "Around the World in Eighty Days" by Jules Verne. It is light, fast-paced and full of surprising turns, which makes it perfect for travelling.
User: How many minutes are there in a day?
Assistant: There are 24 hours in a day and 60 minutes in each hour, so a day has 24 × 60 = 1440 minutes.
天气很好，我们去公园散步吧。学习一门新的技能需要耐心和练习。
Le marché du samedi matin est plein de fruits, de légumes et de fromages de la région.
The recipe is simple: mix two cups of flour with a pinch of salt, add warm water slowly, knead for ten minutes, and let the dough rest for an hour before baking at 220 degrees."""  # noqa: E501
CALIBRATION_SEEDS = [  # chat prompts whose fp32 samples (temperature 0.8) calibrate GPTQ
    "Tell me a story about a lighthouse keeper.", "Explain how a bicycle works.",
    "Write a short poem about autumn leaves.", "What should I pack for a hiking trip?",
    "Describe the water cycle.", "Write a JavaScript function that sums an array.",
    "Why is the sky sometimes red at sunset?", "Give me advice for a job interview.",
    "What are the planets of the solar system?", "Summarize the plot of a detective novel.",
    "How does a computer store numbers?", "请介绍一下长城。", "What is a prime number?",
    "Compare cats and dogs as pets.", "Explain the rules of chess briefly.", "What is democracy?",
]  # fmt: skip


def engine(quantization: str) -> LLM:
    """No prefix caching: the variants share one engine, never each other's prompt KV."""
    return LLM(
        quantization=quantization,
        backend="reference",
        device="cpu",
        max_num_seqs=32,
        kv_cache_gib=0.25,
        enable_prefix_caching=False,
    )


def gemm_input_moments(model, sequences: list[list[int]]) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, linear field) -> E[x x^T] (float64 [K, K]) of that GEMM's inputs over one prefill
    of each sequence (plain path)."""
    names = {id(getattr(layer, f)): (i, f) for i, layer in enumerate(model.weights.layers)
             for f in LINEAR_FIELDS}  # fmt: skip
    sums: dict = {}
    counts: dict = {}
    kernels = llama.linear

    def hook(x, weight, bias=None):
        key = names.get(id(weight))
        if key is not None:
            sums[key] = sums.get(key, 0) + x.double().T @ x.double()
            counts[key] = counts.get(key, 0) + x.shape[0]
        return kernels(x, weight, bias)

    llama.linear = hook
    try:
        for ids in sequences:
            blocks = -(-len(ids) // 16)
            kv = model.allocate_kv_cache(blocks, 16)
            batch, meta = build_batch([SequenceChunk(ids, 0, list(range(blocks)))], 16)
            model.hidden_states(batch, meta, kv)
    finally:
        llama.linear = kernels
    return {key: sums[key] / counts[key] for key in sums}


def gptq_int8(w: torch.Tensor, h: torch.Tensor, damp: float = 0.01, block: int = 128):
    """Per-output-channel int8 of w [N, K] (scale = max|w| / 127, as quantize_int8) with each
    column's rounding error spread over the columns not yet rounded, weighted by the inverse
    input second moment h (GPTQ), columns in decreasing order of h's diagonal."""
    w = w.double().clone()
    n, k = w.shape
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        part, err, hi = (
            w[:, i1:i2].clone(),
            torch.zeros(n, i2 - i1, dtype=w.dtype),
            hinv[i1:i2, i1:i2],
        )
        for j in range(i2 - i1):
            q[:, i1 + j] = torch.round(part[:, j] / scale).clamp(-127, 127)
            err[:, j] = (part[:, j] - q[:, i1 + j] * scale) / hi[j, j]
            part[:, j:] -= err[:, j, None] * hi[j, None, j:]
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(order)].to(torch.int8).contiguous()
    return QuantizedWeight("int8", (n, k), q, scale.float().contiguous())


def output_error(qw: QuantizedWeight, w: torch.Tensor, h: torch.Tensor) -> float:
    """Relative rms GEMM output error over inputs of second moment h."""
    d, w = qw.dequantize_rows().double() - w.double(), w.double()
    return (torch.trace(d @ h @ d.T) / torch.trace(w @ h @ w.T)).sqrt().item()


def main(lever: str) -> None:
    base = engine("none")
    fp32, tok = base.engine.model, base.engine.tokenizer
    ids, _ = greedy_answers(base, MAX_TOKENS)
    prompts = prompt_ids(base)
    answered = [p + a for p, a in zip(prompts, ids, strict=True)]
    logp = token_logprobs(fp32, answered, [len(p) for p in prompts])
    llm = engine("int8")
    model = llm.engine.model
    w8, exact_head = model.weights, fp32.weights.lm_head  # fp32 head: the Q8_0 values exactly
    plain_logits, kernels = model.compute_logits, llama.linear

    def measure(name: str, head, layers=None, logits=None, gemms=None) -> None:
        model.weights = LlamaWeights(head, layers or w8.layers, w8.norm, head, w8.rope_freq_factors)
        model.compute_logits = logits or plain_logits
        if gemms is not None:  # fp32 GEMMs (the model's own linear too: the CPU backend's)
            llama.linear = model._linear = gemms
        try:
            got = agreement(ids, logp, llm, MAX_TOKENS)
            print(
                f"int8 | {name}: identical {round(got.identical * 32)}/32, first divergence "
                f"{sorted(got.first_divergence)}, mean |dlogprob| {got.mean_abs_dlogprob:.4f}, "
                f"NLL {mean_nll(llm):.4f}",
                flush=True,
            )
        finally:
            llama.linear, model.weights = kernels, w8
            model.__dict__.pop("_linear", None)

    q8 = w8.lm_head
    measure("int8 head, torch's int8 kernel (bf16 logits)", q8)
    if lever == "head":
        deq = q8.dequantize_rows()
        bf16 = exact_head.bfloat16().float()
        measure("int8 head, fp32 logits", q8, logits=lambda h: F.linear(h.float(), deq))
        measure("Q8_0 head + embedding in fp32", exact_head)
        measure("Q8_0 head + embedding rounded to bf16, fp32 logits", bf16)
        return
    sampled = base.chat(
        [[{"role": "user", "content": s}] for s in CALIBRATION_SEEDS],
        SamplingParams(max_tokens=160, temperature=0.8, seed=1234, ignore_eos=True),
        use_tqdm=False,
    )
    seeds = [tok.encode(tok.apply_chat_template([{"role": "user", "content": s}],
             add_generation_prompt=True)) for s in CALIBRATION_SEEDS]  # fmt: skip
    calibration = [tok.encode(CALIBRATION_TEXT)]
    calibration += [p + list(g.token_ids) for p, g in zip(seeds, sampled, strict=True)]
    moments = gemm_input_moments(fp32, calibration)
    held_out = gemm_input_moments(fp32, [tok.encode(NLL_TEXT), *answered])
    layers, rtn, gptq = [], [], []
    for i, (dense, nearest) in enumerate(zip(fp32.weights.layers, w8.layers, strict=True)):
        parts = {f.name: getattr(nearest, f.name) for f in fields(LayerWeights)}
        for f in LINEAR_FIELDS:
            parts[f] = gptq_int8(getattr(dense, f), moments[i, f])
            rtn.append(output_error(getattr(nearest, f), getattr(dense, f), held_out[i, f]))
            gptq.append(output_error(parts[f], getattr(dense, f), held_out[i, f]))
        layers.append(LayerWeights(**parts))
    print(
        f"held-out GEMM output error: round to nearest {statistics.mean(rtn):.5f}, "
        f"GPTQ {statistics.mean(gptq):.5f}",
        flush=True,
    )
    measure("GPTQ layers, int8 head", q8, layers)
    measure("GPTQ layers, Q8_0 head in fp32", exact_head, layers)
    measure("GPTQ layers, Q8_0 head in fp32, fp32 GEMMs", exact_head, layers,
            gemms=emulated_linear(False, False, False))  # fmt: skip
    assert llama.linear is kernels


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "head")
