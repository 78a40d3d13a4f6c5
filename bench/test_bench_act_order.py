"""GPTQ act-order on the CPU: the same random SmolLM2-135M-shaped model (30 layers, hidden
576, MLP 1536) as a GPTQ int4 folder in plain order and in act-order (each input's channels in
a random order, g_idx naming their groups), pagedkern's engine (the cpu backend) decoding
greedily at batch 1 and 8, tokens per second, interleaved rounds in one run (median), and the
ratio: what the input gathers (one per GEMM, in the one-call decoder's C++) cost. In smoke
mode a 2-layer model runs once."""

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
SHAPE = dict(
    hidden_size=64 if SMOKE else 576,
    intermediate_size=128 if SMOKE else 1536,
    num_hidden_layers=2 if SMOKE else 30,
    num_attention_heads=4 if SMOKE else 9,
    num_key_value_heads=2 if SMOKE else 3,
    vocab_size=400,  # the test tokenizer's
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.05,
)
PROMPT, NEW, ROUNDS = (8, 4, 1) if SMOKE else (32, 48, 3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_quantized_files import SCHEMES, shared_orders, write_quantized

    made = {}
    for kind, orders in (("plain order", None), ("act-order", shared_orders(1))):
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).float().eval()
        folder = made[kind] = tmp_path_factory.mktemp(kind.replace(" ", "-"))
        write_quantized(folder, hf, SCHEMES["gptq-int4-asym-g32"], orders=orders)
    return made


def _decode(engine: Engine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt_ids=prompt, params=params)
    for _ in engine.run_until_done():
        pass


@pytest.mark.parametrize("batch", [1, 8])
def test_act_order_against_plain_order(record, folders, batch):
    engines = {
        kind: Engine.from_config(EngineConfig(model=str(path), backend="cpu", num_blocks=256))
        for kind, path in folders.items()
    }
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 390, (batch, PROMPT), generator=gen).tolist()
    seconds: dict[str, list[float]] = {kind: [] for kind in engines}
    for engine in engines.values():  # warm-up (weights packed on first use)
        _decode(engine, prompts)
    for _ in range(ROUNDS):
        for kind, engine in engines.items():  # interleaved: both see the same load
            start = time.perf_counter()
            _decode(engine, prompts)
            seconds[kind].append(time.perf_counter() - start)
    rate = {kind: batch * NEW / statistics.median(s) for kind, s in seconds.items()}
    case = f"batch {batch}, {PROMPT}+{NEW} tokens, {torch.get_num_threads()} threads"
    for kind, tok_s in rate.items():
        notes = {"tok_s": f"{tok_s:.1f}", "vs_plain": f"{tok_s / rate['plain order']:.2f}x"}
        record("gptq act-order cpu", case, kind, statistics.median(seconds[kind]), **notes)
