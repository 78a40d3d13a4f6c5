"""A Qwen3-MoE-shaped model end to end on the CPU: pagedkern's engine (the cpu backend) against HF
transformers' own Qwen3-MoE implementation on the same random weights (one folder saved by
transformers), greedy generation at batch 1 and 16, tokens per second, interleaved rounds in one
run (median), and the ratio. Both run fp32 on the same threads; transformers generates with its
own cache (`generate`, no sampling). The first steps' tokens of both are checked equal, so the
two compute the same model. In smoke mode a tiny model runs once."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from measure import smoke_mode

from pagedkern.engine import Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SMOKE = smoke_mode()
# Qwen3-30B-A3B's routing (128 experts, top 8, renormalised) at a width this CPU runs in seconds
SHAPE = dict(
    hidden_size=64 if SMOKE else 512,
    num_hidden_layers=2 if SMOKE else 6,
    num_attention_heads=4 if SMOKE else 8,
    num_key_value_heads=2 if SMOKE else 4,
    head_dim=16 if SMOKE else 64,
    intermediate_size=96 if SMOKE else 1536,
    moe_intermediate_size=32 if SMOKE else 192,
    num_experts=8 if SMOKE else 128,
    num_experts_per_tok=2 if SMOKE else 8,
    norm_topk_prob=True,
    vocab_size=400,  # the test tokenizer's
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
PROMPT, NEW = (8, 4) if SMOKE else (48, 32)
ROUNDS = 1 if SMOKE else 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_model_files import write_tokenizer

    folder = tmp_path_factory.mktemp("qwen3_moe_e2e")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(initializer_range=0.2, **SHAPE)
    transformers.Qwen3MoeForCausalLM(config).float().eval().save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def _prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(3, 390, (batch, PROMPT), generator=gen).tolist()


def _pagedkern(engine: Engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt_ids=p, params=params).request_id for p in prompts]
    finals = {o.request_id: o for o in engine.run_until_done() if o.finished}
    return [list(finals[i].output_token_ids) for i in ids]


def _transformers(model, prompts) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor(prompts), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            attention_mask=torch.ones(len(prompts), PROMPT, dtype=torch.long), pad_token_id=0,
        )  # fmt: skip
    return out[:, PROMPT:].tolist()


@pytest.mark.parametrize("batch", [1, 16])
def test_qwen3_moe_end_to_end_against_transformers(record, folder, batch):
    engine = Engine.from_config(
        EngineConfig(
            model=str(folder),
            backend="cpu",
            device="cpu",
            enable_prefix_caching=False,
            max_num_seqs=16,
            max_num_batched_tokens=1024,
        )  # fmt: skip
    )
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    hf.eval()
    prompts = _prompts(batch)
    runs = {
        "pagedkern": lambda: _pagedkern(engine, prompts),
        "transformers": lambda: _transformers(hf, prompts),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    for name, run in runs.items():  # warm-up
        tokens[name] = run()
    # random weights: the first tokens agree (later ones may part at a near-tie)
    assert [t[:2] for t in tokens["pagedkern"]] == [t[:2] for t in tokens["transformers"]]
    for _ in range(ROUNDS):
        for name, run in runs.items():  # interleaved: both see the same load
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    rate = {name: batch * NEW / statistics.median(s) for name, s in seconds.items()}
    case = f"{SHAPE['num_experts']} experts top {SHAPE['num_experts_per_tok']}, batch {batch}"
    case += f", {PROMPT}+{NEW} tokens, {torch.get_num_threads()} threads"
    for name, tok_s in rate.items():
        notes = {"tok_s": f"{tok_s:.1f}"}
        if name == "pagedkern":
            notes["vs_transformers"] = f"{tok_s / rate['transformers']:.2f}x"
        record("qwen3-moe e2e cpu", case, name, statistics.median(seconds[name]), **notes)
