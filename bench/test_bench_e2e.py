"""End-to-end serving benchmarks (bench/e2e.py) for the default model and the reference
document's 8B shape (synthetic weights): offline throughput, online latency, batch-1 decode vs
the weight-bandwidth roofline, the reference backend and HF transformers on the same workload,
asynchronous scheduling off and on (the overlap record).
Targets on an H200: batch-1 decode of the 8B shape >= 80% of the roofline; offline throughput
of the 8B shape >= 10x HF transformers; the CUDA backend >= 3x the reference backend.
Smoke mode: the tiny synthetic model on the CPU reference ops, a handful of short requests."""

from __future__ import annotations

import pytest
import torch
from e2e import decode_roofline, make_workload, run_hf, run_offline, run_online, warm_up
from measure import smoke_mode

from pagedkern.engine import Engine, EngineConfig
from pagedkern.engine.overlap import Overlap
from pagedkern.model import ModelLoadError, default_model_path

SMOKE = smoke_mode()
MODELS = ["synthetic:tiny"] if SMOKE else ["smollm2 (default)", "synthetic:seed"]
OFFLINE = (8, (4, 16)) if SMOKE else (256, (100, 1024))  # requests, length range
ONLINE = (8, 50.0) if SMOKE else (64, 8.0)  # requests, arrivals per second
SUBSET = (4, 8) if SMOKE else (32, 128)  # requests, output tokens: A/B against slower stacks


@pytest.fixture(scope="module", params=MODELS)
def engine(request) -> Engine:
    model = None if request.param.startswith("smollm2") else request.param
    if model is None and not default_model_installed():
        model = "synthetic:smollm2-135m"  # same shape and speed; the GGUF may not be carried
    config = EngineConfig(
        model=model,
        backend="reference" if SMOKE else "cuda",
        device="cpu" if SMOKE else None,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_fraction=0.8,
    )
    engine = Engine.from_config(config)
    warm_up(engine)
    yield engine
    engine.close()  # its GPU memory back for the next model's engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def default_model_installed() -> bool:
    try:
        return default_model_path().is_file()
    except ModelLoadError:
        return False


def fixed_length_jobs(engine: Engine, n: int, tokens: int, seed: int):
    """n requests of prompts 100-512 tokens long (20-48 in smoke mode: a full block or more,
    which a prefix cache could hold), `tokens` out each."""
    prompts = (20, 48) if SMOKE else (100, 512)
    return make_workload(n, prompts, (tokens, tokens), engine.model.config.vocab_size, seed=seed)


def _case(engine: Engine) -> str:
    return f"{engine.model.config.name} {str(engine.model.dtype).removeprefix('torch.')}"


def test_offline_throughput(engine, record):
    n, lens = OFFLINE
    jobs = make_workload(n, lens, lens, engine.model.config.vocab_size)
    r = run_offline(engine, jobs)
    assert r["output_tokens"] == sum(j.max_tokens for j in jobs)
    record(
        "e2e offline",
        f"{_case(engine)}, {n} req",
        "pagedkern",
        r["seconds"],
        out_tok_s=r["output_tokens_per_s"],
        total_tok_s=r["total_tokens_per_s"],
    )
    assert engine.pool.num_used == 0


def test_online_latency(engine, record):
    n, rate = ONLINE
    jobs = make_workload(
        n,
        (100, 512) if not SMOKE else (4, 16),
        (64, 256) if not SMOKE else (4, 16),
        engine.model.config.vocab_size,
        seed=1,
    )
    r = run_online(engine, jobs, rate)
    assert r["requests"] == n
    record(
        "e2e online",
        f"{_case(engine)}, {rate:g} req/s",
        "pagedkern",
        r["seconds"],
        ttft_mean_ms=r["ttft_ms"]["mean"],
        ttft_p99_ms=r["ttft_ms"]["p99"],
        tpot_median_ms=r["tpot_ms"]["median"],
        itl_p99_ms=r["itl_ms"]["p99"],
        out_tok_s=r["output_tokens_per_s"],
    )


def test_batch1_decode_vs_roofline(engine, record, request):
    copy = 1.0 if SMOKE else request.getfixturevalue("copy_gbps")
    r = decode_roofline(engine, 16 if SMOKE else 1024, copy)
    assert r["seconds_per_token"] > 0
    record(
        "e2e batch-1 decode",
        f"{_case(engine)}, context {r['context']}",
        "pagedkern",
        r["seconds_per_token"],
        bytes=r["weight_bytes"],
        roofline_fraction=r["fraction_of_roofline"],
        host_launches_per_step=r["host_launches_per_step"],
        graph_replays=f"{r['graph_replays']}/{r['decode_steps']}",
    )
    assert r["graph_replays"] <= r["decode_steps"]


def test_cuda_backend_vs_reference_backend(engine, record):
    n, tokens = SUBSET
    jobs = fixed_length_jobs(engine, n, tokens, seed=2)
    fast = run_offline(engine, jobs)
    graphs, engine.runner.graphs = engine.runner.graphs, None  # graphs hold captured kernels
    backend, engine.backend = engine.backend, "reference"  # the engine's own op backend
    try:
        slow = run_offline(engine, jobs)
    finally:
        engine.runner.graphs, engine.backend = graphs, backend
    record(
        "e2e backends",
        f"{_case(engine)}, {n} req x {tokens}",
        "reference backend",
        slow["seconds"],
        out_tok_s=slow["output_tokens_per_s"],
    )
    record(
        "e2e backends",
        f"{_case(engine)}, {n} req x {tokens}",
        f"{engine.config.backend} backend",
        fast["seconds"],
        out_tok_s=fast["output_tokens_per_s"],
        speedup=slow["seconds"] / fast["seconds"],
    )


def test_async_scheduling_off_vs_on(engine, record):
    """Offline throughput with the engine's steps synchronous, then overlapped (the host
    schedules and lays out step N+1 while step N runs), same engine and jobs: the fixture's
    engine gets an Overlap for the second run (what EngineConfig.async_scheduling builds), as
    a second engine of the 8B shape would not fit beside the first. Greedy: the outputs must
    be token for token the same. Both runs start from the same cache state (prefix caching off
    for the two): the second run would otherwise find every prompt cached and run other
    steps, and the GPU kernels' rounding depends on the batch (cuBLAS by M, the attention
    split plan by batch size), which flipped near-ties in the first GPU run. The two runs
    must execute the same steps; then any token that differs is the overlap's fault."""
    n, tokens = (8, 8) if SMOKE else (64, 128)
    jobs = fixed_length_jobs(engine, n, tokens, seed=4)
    pool, execute = engine.pool, engine.runner.execute
    steps: list[list[tuple]] = [[], []]
    caching, pool.enable_prefix_caching = pool.enable_prefix_caching, False
    try:
        engine.runner.execute = _recording(execute, steps[0])
        off = run_offline(engine, jobs)
        engine.runner.execute = _recording(execute, steps[1])
        engine.overlap = Overlap(engine.runner, engine.scheduler, engine.backend)
        try:
            on = run_offline(engine, jobs)
            overlapped = engine.overlap.num_overlapped
        finally:
            engine.overlap.close()
            engine.overlap = None
    finally:
        pool.enable_prefix_caching = caching
        engine.runner.execute = execute
    assert steps[1] == steps[0], "the runs executed different steps"
    assert on["token_ids"] == off["token_ids"]
    assert overlapped > 0
    case = f"{_case(engine)}, {n} req x {tokens}"
    record(
        "e2e async scheduling",
        case,
        "overlap off",
        off["seconds"],
        out_tok_s=off["output_tokens_per_s"],
    )
    record(
        "e2e async scheduling",
        case,
        "overlap on",
        on["seconds"],
        out_tok_s=on["output_tokens_per_s"],
        speedup=off["seconds"] / on["seconds"],
        overlapped_steps=overlapped,
    )
    assert engine.pool.num_used == 0


def _recording(execute, into: list[tuple]):
    """runner.execute, noting each step's (tokens, sequences, prefills, logit rows)."""

    def recorded(step, previous=None):
        layout = step.layout
        shape = (len(layout.input_ids), len(layout.seq_lens), layout.num_prefills)
        into.append((*shape, len(layout.logits_indices)))
        return execute(step, previous)

    return recorded


def test_hf_transformers_generate(engine, record):
    if SMOKE:
        pytest.skip("smoke mode: HF transformers is compared on the GPU only")
    n, tokens = SUBSET
    jobs = fixed_length_jobs(engine, n, tokens, seed=3)
    hf = run_hf(engine.model.config, jobs, "cuda", engine.model.dtype)
    if hf is None:
        pytest.skip("transformers is not installed")
    ours = run_offline(engine, jobs)
    record(
        "e2e vs HF",
        f"{_case(engine)}, {n} req x {tokens}",
        "HF generate",
        hf["seconds"],
        out_tok_s=hf["output_tokens_per_s"],
    )
    record(
        "e2e vs HF",
        f"{_case(engine)}, {n} req x {tokens}",
        "pagedkern",
        ours["seconds"],
        out_tok_s=ours["output_tokens_per_s"],
        speedup=hf["seconds"] / ours["seconds"],
    )
