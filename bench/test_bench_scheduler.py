"""Scheduler + block-pool overhead of one decode iteration with 256 running sequences (CPU,
pytest-benchmark's own timer). Target: <= 250 us per iteration on the 2-core dev machine."""

from __future__ import annotations

from pagedkern.engine.block_pool import BlockPool
from pagedkern.engine.request import Request
from pagedkern.engine.sampling_params import SamplingParams
from pagedkern.engine.scheduler import Scheduler, SchedulerConfig


def test_decode_iteration_with_256_running(benchmark):
    pool = BlockPool(num_blocks=256 * 48, block_size=16)  # room for every round below
    scheduler = Scheduler(
        pool, SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    )
    for i in range(256):
        prompt = [(i * 7 + j) % 1000 for j in range(100 + i)]
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=10**6)))
    while len(scheduler.running) < 256 or any(r.num_uncomputed > 1 for r in scheduler.running):
        batch = scheduler.schedule()
        scheduler.on_step_done(batch)
        for r in scheduler.ready(batch):
            r.output_ids.append(1)

    def iteration():
        batch = scheduler.schedule()
        scheduler.on_step_done(batch)
        for r in scheduler.ready(batch):
            r.output_ids.append(1)
        return batch

    batch = benchmark.pedantic(iteration, rounds=300, warmup_rounds=10, iterations=1)
    assert len(batch.entries) == 256 and batch.num_tokens == 256
    pool.check_invariants(scheduler.block_tables())
