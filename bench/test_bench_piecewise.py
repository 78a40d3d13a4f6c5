"""Mixed steps (prefill chunks + decodes) eager vs piecewise CUDA graphs (engine/
piecewise_graphs.py) on the default model's shape, whose 30 small layers make a mixed step
launch-bound: ~10 host launches per layer eagerly, attention's 3 and one replay per layer with
the pieces. Each call is a whole step: upload, forward, logits. GB/s counts the weights read
once per step (the memory-bound floor of a small step) against the measured copy ceiling.
Target: piecewise faster than eager where the step is launch-bound (few tokens), no slower at
2048 tokens. Smoke mode: the tiny model on the CPU, the pieces run uncaptured."""

from __future__ import annotations

import random

import pytest
from measure import smoke_mode

from pagedkern.engine.piecewise_graphs import PiecewiseGraphs
from pagedkern.model import SequenceChunk, layout_batch, load_model

SMOKE = smoke_mode()
BLOCK = 16
MAX_TOKENS = 128 if SMOKE else 2048
# (prefill chunk lengths, decodes) per case
CASES = (
    [([8], 7), ([100], 15)] if SMOKE else [([8], 7), ([100], 27), ([400, 300], 60), ([1980], 60)]
)


def _chunks(prefill_lens: list[int], decodes: int, vocab: int) -> list[SequenceChunk]:
    rng = random.Random(0)
    chunks, next_block = [], 0
    for length in [*prefill_lens, *[1] * decodes]:
        computed = 0 if length > 1 else rng.randrange(100, 500)
        blocks = -(-(computed + length) // BLOCK)
        ids = [rng.randrange(vocab) for _ in range(length)]
        chunks.append(SequenceChunk(ids, computed, list(range(next_block, next_block + blocks))))
        next_block += blocks
    return chunks


@pytest.fixture(scope="module")
def setup(device):
    model, _ = load_model("synthetic:tiny" if SMOKE else "synthetic:smollm2-135m", device)
    kv = model.allocate_kv_cache(4096 if not SMOKE else 512, BLOCK)
    graphs = PiecewiseGraphs(model, kv, 64, MAX_TOKENS, max_model_len=4096)
    if not SMOKE:
        graphs.capture()
    return model, kv, graphs


@pytest.mark.parametrize("prefill_lens, decodes", CASES)
@pytest.mark.parametrize("impl", ["eager", "piecewise graphs"])
def test_mixed_step(setup, measure, device, impl, prefill_lens, decodes):
    model, kv, graphs = setup
    layout = layout_batch(_chunks(prefill_lens, decodes, model.config.vocab_size), BLOCK)
    if impl == "eager":
        fn = lambda: model(*layout.upload(device), kv)  # noqa: E731
    else:
        fn = lambda: graphs.run(layout)  # noqa: E731
    case = (
        f"{len(layout.input_ids)} tokens: {len(prefill_lens)} prefill chunk(s) + {decodes} decodes"
    )
    result = measure("mixed step", case, impl, fn, bytes=model.weights.nbytes, baseline="eager")
    assert result.seconds > 0
