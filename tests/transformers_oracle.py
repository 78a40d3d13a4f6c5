"""HF transformers as the oracle of the model-family tests (test_model_transformers, _gemma,
_moe): its greedy tokens and the logits each came from, pagedkern's logits step by step over
the paged cache, the error measure, and the engine checks every family runs the same way."""

from __future__ import annotations

import torch

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.model import SequenceChunk, build_batch


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits each was chosen from ([steps, V])."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack([lg[0] for lg in out.logits])


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def decode_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of the prompt's prefill, then of each of `tokens` fed as one decode step (every
    step through the decode path: paged_attention), [1 + len(tokens), V]."""
    block, blocks = 4, 32
    kv = model.allocate_kv_cache(blocks, block)
    table = list(range(blocks))
    rows = []
    ids, meta = build_batch([SequenceChunk(prompt, 0, table)], block)
    rows.append(model(ids, meta, kv)[0])
    for n, token in enumerate(tokens):
        ids, meta = build_batch([SequenceChunk([token], len(prompt) + n, table)], block)
        rows.append(model(ids, meta, kv)[0])
    return torch.stack(rows)


def assert_logprobs_follow(outputs, want_tokens: list[int], want_logits: torch.Tensor) -> None:
    """The engine's greedy tokens are transformers', each with its log-probability there."""
    assert [t for o in outputs for t in o.token_ids] == want_tokens
    logprobs = [lp.logprob for o in outputs for lp in (o.logprobs or ())]
    want = torch.log_softmax(want_logits.double(), -1)
    expected = want[torch.arange(len(want_tokens)), torch.tensor(want_tokens)]
    assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), expected, atol=1e-4)


def assert_a_prefix_cache_hit_changes_nothing(folder, hf, prompt: list[int]) -> None:
    want_tokens, _ = hf_greedy(hf, prompt, 8)
    engine = Engine.from_config(
        EngineConfig(model=str(folder), backend="reference", num_blocks=64, block_size=4)
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second run finds the prompt's full blocks cached
        engine.add_request(prompt_ids=prompt, params=params)
        assert [t for o in engine.run_until_done() for t in o.token_ids] == want_tokens
    assert engine.pool.prefix_hits > 0


def engine_greedy(folder, prompt: list[int], steps: int, **engine_args) -> list:
    """The engine's greedy outputs (with each token's logprob) for `prompt`, in fp32 (the cache
    too) on the reference ops, over small blocks so the prompt spans several."""
    engine = Engine.from_config(
        EngineConfig(
            model=str(folder), backend="reference", dtype="float32", kv_cache_dtype="float32",
            num_blocks=64, block_size=4, **engine_args,
        )
    )  # fmt: skip
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(prompt_ids=prompt, params=params)
    return list(engine.run_until_done())


def assert_preemption_and_batching_change_nothing(
    folder, hf, prompt: list[int], **engine_args
) -> None:
    """Four rotations of the prompt in a pool that holds two: preempted, recomputed (prompt and
    generated tokens prefilled again) and batched with each other, each still transformers'
    greedy answer. A model windowed on every layer releases the blocks behind its window: it
    needs other engine_args (a smaller pool, chunked prefill) to be preempted."""
    prompts = [prompt[i:] + prompt[:i] for i in (0, 3, 7, 11)]
    want = [hf_greedy(hf, p, 12)[0] for p in prompts]
    config = {"backend": "reference", "num_blocks": 18, "block_size": 4, **engine_args}
    engine = Engine.from_config(EngineConfig(model=str(folder), **config))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests = [engine.add_request(prompt_ids=p, params=params) for p in prompts]
    got: dict[str, list[int]] = {}
    for output in engine.run_until_done():
        got.setdefault(output.request_id, []).extend(output.token_ids)
    assert [got[r.request_id] for r in requests] == want
    assert sum(r.num_preemptions for r in requests) > 0
