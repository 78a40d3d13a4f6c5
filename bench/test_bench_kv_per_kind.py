"""KV bytes per sequence of hybrid local/global models, one block table for every layer vs
per-kind tables (model/kv_cache.py KVLayerGroups, engine/hybrid_tables.py), at 8k and 32k
context, and the largest batch a fixed KV budget holds. No model runs: the engine's own pool
and scheduler feed one sequence (prompt prefilled in max_num_batched_tokens chunks, then
decode steps) and count the blocks each kind holds; bytes are blocks x the engine's block
size in bytes (kv_block_bytes, bf16). A memory count, not a timing: the same on any host.

`python -m pytest bench/test_bench_kv_per_kind.py -s` prints the table."""

from __future__ import annotations

import pytest
import torch

from pagedkern.engine.block_pool import BlockPool
from pagedkern.engine.request import Request
from pagedkern.engine.sampling_params import SamplingParams
from pagedkern.engine.scheduler import Scheduler, SchedulerConfig
from pagedkern.model.config import FULL, PRESETS, SLIDING
from pagedkern.model.kv_cache import kv_block_bytes, kv_layer_groups

BLOCK = 16
CHUNK = 2048  # EngineConfig's max_num_batched_tokens
BUDGET_GIB = 40  # the fixed KV budget of the batch column (an H100's left after 27B in bf16)
DECODE_STEPS = 64
GIB = 2**30

# Gemma 3 27B's text shape (62 layers, 5 local per global, window 1024, 16 KV heads x 128)
GEMMA3_27B = PRESETS["gemma3-1b"].replace(
    name="gemma3-27b-shaped",
    num_layers=62,
    num_heads=32,
    num_kv_heads=16,
    head_dim=128,
    hidden_size=5376,
    sliding_window=1024,
    layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(62)),
    max_position_embeddings=131072,
)
CONFIGS = [GEMMA3_27B, PRESETS["gemma3-1b"], PRESETS["gemma2-2b"]]
_ROWS: list[str] = []


def _held_blocks(config, context: int) -> tuple[list[int], list[int]]:
    """(blocks held per kind at `context` tokens, the most held on the way) of one sequence
    fed through the scheduler with per-kind tables: prompt of context - DECODE_STEPS tokens in
    CHUNK chunks, then DECODE_STEPS decode steps."""
    groups = kv_layer_groups(config)
    blocks = 2 + groups.blocks_for(context, BLOCK, 2 * CHUNK)
    pool = BlockPool(blocks, BLOCK, enable_prefix_caching=True, reserve_null_block=True)
    scheduler = Scheduler(
        pool,
        SchedulerConfig(
            max_model_len=context + 1,
            max_num_batched_tokens=CHUNK,
            group_windows=groups.windows[1:],
        ),
    )
    prompt = [(7 * i) % 50000 for i in range(context - DECODE_STEPS)]
    request = Request("r", tuple(prompt), SamplingParams(max_tokens=DECODE_STEPS + 1))
    scheduler.add(request)
    while request.num_computed_tokens < context:
        batch = scheduler.schedule()
        assert batch.entries and not batch.preempted
        scheduler.on_step_done(batch)
        if request.num_computed_tokens == request.num_tokens:
            request.output_ids.append(1)  # the sampled token (any id: no model runs)
    pool.check_invariants(scheduler.block_tables())
    return list(pool.used_by_kind), list(pool.peak_by_kind)


@pytest.mark.parametrize("context", [8192, 32768])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_kv_bytes_per_sequence(config, context):
    dtype = torch.bfloat16
    groups = kv_layer_groups(config)
    plain_block = kv_block_bytes(config, BLOCK, dtype)
    group_block = kv_block_bytes(config, BLOCK, dtype, groups)
    plain = -(-context // BLOCK) * plain_block
    used, peak = _held_blocks(config, context)
    per_kind = sum(used) * group_block
    per_kind_peak = sum(peak) * group_block
    # what a plain table would hold: every group's blocks for every token
    full_groups = sum(w is None for w in groups.windows)
    assert used[0] == full_groups * -(-context // BLOCK)
    window_blocks = -(-(config.sliding_window - 1) // BLOCK) + 1
    assert used[1] <= (groups.num_groups - full_groups) * window_blocks
    assert per_kind < plain
    budget = BUDGET_GIB * GIB
    batch_plain = budget // plain
    capacity = budget // group_block - 1  # the null block
    batch_per_kind = capacity // sum(used)
    _ROWS.append(
        f"| {config.name} | {context // 1024}k | {plain / 2**20:,.0f} | {per_kind / 2**20:,.0f} "
        f"| {per_kind_peak / 2**20:,.0f} | {plain / per_kind:.2f}x | {batch_plain} "
        f"| {batch_per_kind} |"
    )


def teardown_module():
    if _ROWS:
        print(
            "\n| config | context | one table MiB/seq | per-kind MiB/seq (decode) "
            "| per-kind peak MiB/seq (2048-token prefill chunks) | saving | batch in "
            f"{BUDGET_GIB} GiB, one table | per-kind |\n|---|---|---|---|---|---|---|---|"
        )
        print("\n".join(_ROWS))
