"""The architectures beyond Llama end to end on the CPU: Qwen3-shaped (QK-norm), Gemma-3-shaped
(5 local layers per global one, a window shorter than the context) and Qwen3-MoE-shaped (128
experts, top 8) random models, pagedkern's engine (the cpu backend) against HF transformers' own
implementation on the same weights (one folder saved by transformers): greedy generation at
batch 1 and 16, tokens per second, interleaved rounds in one run (median), the ratio, and the KV
bytes pagedkern holds per sequence at the end (its peak blocks in use; Gemma 3's local layers
keep only their window). Both run fp32 on the same threads; transformers generates with its
own cache (`generate`, no sampling; its MoE runs transformers' default experts implementation,
grouped_mm on this torch). The first tokens of both are checked equal, so the two compute the
same model. MoE families add a row of pagedkern with the reference's fused_moe (a loop over the
experts) in place of the CPU backend's (ops/cpu/moe.py), in the same rounds. In smoke mode tiny
models run once."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from measure import smoke_mode

from pagedkern import reference
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.ops import cpu

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SMOKE = smoke_mode()
COMMON = dict(
    hidden_size=64 if SMOKE else 512,
    num_hidden_layers=2 if SMOKE else 6,
    num_attention_heads=4 if SMOKE else 8,
    num_key_value_heads=2 if SMOKE else 4,
    head_dim=16 if SMOKE else 64,
    intermediate_size=96 if SMOKE else 1536,
    vocab_size=400,  # the test tokenizer's
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.2,
)
FAMILIES = {  # name -> (config class, model class, the family's own fields)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(sliding_window=8 if SMOKE else 32, sliding_window_pattern=6, query_pre_attn_scalar=64),
    ),
    "qwen3_moe": (  # Qwen3-30B-A3B's routing at a width this CPU runs in seconds
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            moe_intermediate_size=32 if SMOKE else 192,
            num_experts=8 if SMOKE else 128,
            num_experts_per_tok=2 if SMOKE else 8,
            norm_topk_prob=True,
        ),
    ),
}
PROMPT, NEW = (8, 4) if SMOKE else (48, 32)
ROUNDS = 1 if SMOKE else 3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory) -> tuple[Path, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_model_files import write_tokenizer

    config_class, model_class, fields = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **fields)
    getattr(transformers, model_class)(config).float().eval().save_pretrained(folder)
    write_tokenizer(folder)
    return folder, request.param


def _prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(3, 390, (batch, PROMPT), generator=gen).tolist()


def _pagedkern(engine: Engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt_ids=p, params=params).request_id for p in prompts]
    finals = {o.request_id: o for o in engine.run_until_done() if o.finished}
    return [list(finals[i].output_token_ids) for i in ids]


def _with_reference_moe(run):
    """run() with the CPU backend's fused_moe swapped for the reference's (the loop)."""
    fast = cpu.implementations.fused_moe
    cpu.implementations.fused_moe = reference.fused_moe
    try:
        return run()
    finally:
        cpu.implementations.fused_moe = fast


def _transformers(model, prompts) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor(prompts), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            attention_mask=torch.ones(len(prompts), PROMPT, dtype=torch.long), pad_token_id=0,
        )  # fmt: skip
    return out[:, PROMPT:].tolist()


@pytest.mark.parametrize("batch", [1, 16])
def test_end_to_end_against_transformers(record, folder, batch):
    path, family = folder
    engine = Engine.from_config(
        EngineConfig(
            model=str(path),
            backend="cpu",
            device="cpu",
            enable_prefix_caching=False,
            max_num_seqs=16,
            max_num_batched_tokens=1024,
        )  # fmt: skip
    )
    hf = getattr(transformers, FAMILIES[family][1]).from_pretrained(path, dtype=torch.float32)
    hf.eval()
    prompts = _prompts(batch)
    runs = {
        "pagedkern": lambda: _pagedkern(engine, prompts),
        "transformers": lambda: _transformers(hf, prompts),
    }
    if family.endswith("_moe"):
        runs["pagedkern, reference MoE"] = lambda: _with_reference_moe(runs["pagedkern"])
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    for name, run in runs.items():  # warm-up
        tokens[name] = run()
    # random weights: the first tokens agree (later ones may part at a near-tie)
    for name in tokens:
        assert [t[:2] for t in tokens[name]] == [t[:2] for t in tokens["transformers"]], name
    for _ in range(ROUNDS):
        for name, run in runs.items():  # interleaved: both see the same load
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    rate = {name: batch * NEW / statistics.median(s) for name, s in seconds.items()}
    cache = engine.kv_cache.data
    block_bytes = cache.nbytes // cache.shape[2]
    kv_per_seq = sum(engine.pool.peak_by_kind) * block_bytes / batch
    case = f"{family}, batch {batch}, {PROMPT}+{NEW} tokens, {torch.get_num_threads()} threads"
    for name, tok_s in rate.items():
        notes = {"tok_s": f"{tok_s:.1f}"}
        if name.startswith("pagedkern"):
            notes["vs_transformers"] = f"{tok_s / rate['transformers']:.2f}x"
        if name == "pagedkern":
            notes["kv_kib_per_seq"] = f"{kv_per_seq / 1024:.0f}"
        record("e2e cpu", case, name, statistics.median(seconds[name]), **notes)
