"""Agreement of a quantized mode with fp32 on the default model (shared by
test_quant_end_to_end.py and bench/test_bench_quant.py): greedy answers to 32 varied prompts
(identical answers, first divergence position), mean |delta logprob| of fp32's chosen tokens
under the other mode (teacher-forced), and the mean NLL of a fixed text."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkern.engine import LLM, SamplingParams
from pagedkern.model import SequenceChunk, build_batch

PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "def fibonacci(n):",
    "Write a Python function that reverses a string.",
    "What is the largest planet in the solar system?",
    "How many legs does a spider have?",
    "法国的首都是哪里？",
    "List two benefits of exercise.",
    "What does CPU stand for?",
    "Tell me a fun fact about octopuses.",
    "What is the square root of 81?",
    "Who painted the Mona Lisa?",
    "Describe the color blue to someone who cannot see.",
    "What is the chemical symbol for gold?",
    "Suggest a name for a pet cat.",
    "What year did the Second World War end?",
    "Explain what a black hole is.",
    "Write one sentence about the ocean.",
    "What is the opposite of cold?",
    "How do you say thank you in French?",
    "What is machine learning?",
    "Name a famous physicist.",
    "What is the freezing point of water in Fahrenheit?",
    "Give a tip for learning a new language.",
]

NLL_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the "
    "centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution. Although initially criticised by some of France's leading artists "
    "and intellectuals for its design, it has since become a global cultural icon of France "
    "and one of the most recognisable structures in the world."
)


@dataclass(slots=True)
class Agreement:
    identical: float  # fraction of prompts whose greedy answer equals fp32's
    first_divergence: list[int]  # per diverging prompt: index of the first differing token
    mean_abs_dlogprob: float  # over fp32's answer tokens, teacher-forced
    answers: list[str]


def greedy_answers(llm: LLM, max_tokens: int) -> tuple[list[list[int]], list[str]]:
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = llm.chat(chats, params, use_tqdm=False)
    return [list(g.token_ids) for g in out], [g.text for g in out]


def token_logprobs(model, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """Per sequence: log p(token t | tokens < t) for t >= start. One batched prefill over all
    sequences (CPU forward passes are batch invariant: each row is what a prefill of its
    sequence alone gives), and the LM head only on the rows that predict a scored token."""
    block = 16
    chunks, rows, first_block = [], [], 0
    for ids in sequences:
        blocks = -(-len(ids) // block)
        chunks.append(SequenceChunk(ids, 0, list(range(first_block, first_block + blocks))))
        first_block += blocks
    kv = model.allocate_kv_cache(first_block, block)
    batch, meta = build_batch(chunks, block)
    begins = meta.cu_seqlens[:-1].tolist()
    for ids, start, begin in zip(sequences, starts, begins, strict=True):
        rows.append(torch.arange(begin + start - 1, begin + len(ids) - 1))
    hidden = model.hidden_states(batch, meta, kv)
    logits = model.compute_logits(hidden[torch.cat(rows)]).double()
    logp = torch.log_softmax(logits, dim=-1).split([len(r) for r in rows])
    return [
        lp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
        for lp, ids, start in zip(logp, sequences, starts, strict=True)
    ]


def agreement(
    base_ids: list[list[int]], base_logp: list[torch.Tensor], llm: LLM, max_tokens: int
) -> Agreement:
    ids, texts = greedy_answers(llm, max_tokens)
    same = sum(a == b for a, b in zip(ids, base_ids, strict=True))
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(ids, base_ids, strict=True)
        if a != b
    ]
    prompts, seqs = prompt_ids(llm), []
    for p, answer in zip(prompts, base_ids, strict=True):
        seqs.append(p + answer)
    logp = token_logprobs(llm.engine.model, seqs, [len(p) for p in prompts])
    deltas = torch.cat([(a - b).abs() for a, b in zip(logp, base_logp, strict=True)])
    return Agreement(same / len(PROMPTS), first, deltas.mean().item(), texts)


def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer  # rendered, then encoded: what Engine.add_request does
    chats = ([{"role": "user", "content": p}] for p in PROMPTS)
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in chats]


def mean_nll(llm: LLM) -> float:
    """Mean negative log-likelihood (nats/token) of NLL_TEXT under the model."""
    ids = llm.engine.tokenizer.encode(NLL_TEXT)
    return -token_logprobs(llm.engine.model, [ids], [1])[0].mean().item()


# --- Ablations: which rounding costs a mode its agreement (bench/results/2026-12-04-cpu.md) ---
# python tests/quant_agreement.py int8 : per variant, the agreement with fp32 when the layers'
# GEMMs are emulated in fp32 with the kernel's roundings switched on or off one at a time (the
# LM head keeps its kernel). Plain path only: the fast path calls the int-pack kernels itself.


def emulated_linear(bf16_inputs: bool, bf16_outputs: bool, kernel_scales: bool):
    """A llama.linear replacement: x @ W.T in fp32 on the float64-exact dequantized weight
    (scales rounded to bf16 as the CPU kernels see them if kernel_scales), x and/or the output
    rounded to bf16 as the int-pack kernels round them."""
    import torch.nn.functional as F

    from pagedkern.model.quantized_linear import QuantizedWeight
    from pagedkern.reference.quant_gemm import dequantize

    dense: dict[int, torch.Tensor] = {}

    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, QuantizedWeight):
            return F.linear(x, weight, bias)
        if id(weight) not in dense:
            dense[id(weight)] = dequantize(
                weight, torch.bfloat16 if kernel_scales else None
            ).float()
        y = F.linear(x.bfloat16().float() if bf16_inputs else x, dense[id(weight)])
        y = y.bfloat16().float() if bf16_outputs else y
        return y if bias is None else y + bias

    return linear


ABLATIONS = {  # name -> (bf16 inputs, bf16 outputs, bf16 scales); None: the kernels themselves
    "kernels": None,
    "fp32 activations, exact weights": (False, False, False),
    "fp32 activations, bf16 scales": (False, False, True),
    "bf16 inputs only": (True, False, False),
    "bf16 outputs only": (False, True, False),
}


def main(quantization: str, max_tokens: int = 8) -> None:
    from pagedkern.model import llama

    def engine(mode: str) -> LLM:
        # no prefix caching: each ablation reuses this engine, and must not read prompt KV
        # that an earlier one computed with other GEMMs
        return LLM(
            quantization=mode, backend="reference", device="cpu", max_num_seqs=32,
            kv_cache_gib=0.25, enable_prefix_caching=False,
        )  # fmt: skip

    base = engine("none")
    ids, _ = greedy_answers(base, max_tokens)
    prompts = prompt_ids(base)
    logp = token_logprobs(
        base.engine.model,
        [p + a for p, a in zip(prompts, ids, strict=True)],
        [len(p) for p in prompts],
    )
    llm, kernels = engine(quantization), llama.linear
    try:
        for name, flags in ABLATIONS.items():
            llama.linear = kernels if flags is None else emulated_linear(*flags)
            got = agreement(ids, logp, llm, max_tokens)
            print(
                f"{quantization} | {name}: identical {round(got.identical * len(PROMPTS))}/"
                f"{len(PROMPTS)}, first divergence {sorted(got.first_divergence)}, "
                f"mean |dlogprob| {got.mean_abs_dlogprob:.4f}",
                flush=True,
            )
    finally:
        llama.linear = kernels


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "int8")
