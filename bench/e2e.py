"""End-to-end serving benchmarks of the engine (importable by bench/test_bench_e2e.py, or run as a
script): offline throughput in the style of nano-vllm's benchmark (random prompts, uniform prompt
and output lengths, EOS ignored), online latency with Poisson arrivals (TTFT, TPOT, ITL: mean,
median, p99), batch-1 decode against the weight-bandwidth roofline, and HF transformers'
`generate` on a model of the same shape.

    python bench/e2e.py --model synthetic:seed --requests 256 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.ops.launch import count_launches


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    max_tokens: int


def make_workload(
    n: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(
            [rng.randrange(10, vocab_size) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(n)
    ]


def _params(job: Job) -> SamplingParams:
    return SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True)


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def warm_up(engine: Engine) -> None:
    engine.add_request(prompt_ids=[10] * 64, params=SamplingParams(max_tokens=8, ignore_eos=True))
    list(engine.run_until_done())


def run_offline(engine: Engine, jobs: Sequence[Job]) -> dict:
    """All jobs submitted at once; seconds until the last finishes; "token_ids": each job's
    output, in job order."""
    _sync(engine)
    start = time.perf_counter()
    ids = [
        engine.add_request(prompt_ids=job.prompt_ids, params=_params(job)).request_id
        for job in jobs
    ]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    for o in engine.run_until_done():
        outputs[o.request_id] += o.token_ids
    _sync(engine)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(t) for t in outputs.values())
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    return {
        "requests": len(jobs),
        "seconds": seconds,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / seconds,
        "token_ids": [outputs[i] for i in ids],
    }


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def run_online(engine: Engine, jobs: Sequence[Job], rate: float, seed: int = 0) -> dict:
    """Jobs arrive as a Poisson process of `rate` requests/s; latency statistics in ms."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in jobs:
        t += rng.expovariate(rate)
        arrivals.append(t)
    pending = list(zip(arrivals, jobs, strict=True))
    finished = []
    start = time.perf_counter()
    while pending or engine.has_unfinished:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, job = pending.pop(0)
            engine.add_request(prompt_ids=job.prompt_ids, params=_params(job))
        if not engine.has_unfinished:
            time.sleep(max(0.0, pending[0][0] - now))  # idle until the next arrival
            continue
        finished += [o.metrics for o in engine.step() if o.finished]
    seconds = time.perf_counter() - start
    metrics = finished
    ms = 1e3
    return {
        "requests": len(finished),
        "rate": rate,
        "seconds": seconds,
        "ttft_ms": _summary([m.ttft * ms for m in metrics if m.ttft is not None]),
        "tpot_ms": _summary([m.tpot * ms for m in metrics if m.tpot is not None]),
        "itl_ms": _summary([x * ms for m in metrics for x in m.itl]),
        "output_tokens_per_s": sum(m.num_output_tokens for m in metrics) / seconds,
    }


def weight_bytes(engine: Engine) -> int:
    """Bytes a decode step must read for weights (embedding rows excepted, LM head included)."""
    w = engine.model.weights
    tensors = [w.norm, w.lm_head]
    for layer in w.layers:
        tensors += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def decode_roofline(engine: Engine, context: int, copy_gbps: float) -> dict:
    """Batch-1 decode: measured seconds per token vs (weights + KV read) / copy bandwidth."""
    cfg = engine.model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context
    kv_bytes = kv * engine.model.dtype.itemsize
    bound = (weight_bytes(engine) + kv_bytes) / (copy_gbps * 1e9)
    tokens = 128
    engine.add_request(
        prompt_ids=[11] * context,
        params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
    )
    with count_launches() as launches:
        outputs = list(engine.run_until_done())
    itl = outputs[-1].metrics.itl
    per_token = statistics.median(itl)
    steps = len(itl) + 1  # the prefill step, then one decode step per further token
    return {
        "context": context,
        "seconds_per_token": per_token,
        "roofline_seconds": bound,
        "fraction_of_roofline": bound / per_token,
        "weight_bytes": weight_bytes(engine),
        # what the host launched per step (a replayed CUDA graph counts once: its kernels are
        # the driver's), and how many decode steps were graph replays
        "host_launches_per_step": round(sum(launches.values()) / steps, 1),
        "graph_replays": launches["graph_replay"],
        "decode_steps": len(itl),
    }


def run_hf(config, jobs: Sequence[Job], device: str, dtype: torch.dtype) -> dict | None:
    """HF transformers' generate on a randomly initialised Llama of the same shape (speed
    only), batched with left padding, greedy; None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(dtype).eval()
    longest = max(len(j.prompt_ids) for j in jobs)
    ids = torch.zeros(len(jobs), longest, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, job in enumerate(jobs):
        ids[i, longest - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
        mask[i, longest - len(job.prompt_ids) :] = 1
    new_tokens = max(j.max_tokens for j in jobs)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - longest) * len(jobs)
    del model
    return {
        "requests": len(jobs),
        "seconds": seconds,
        "output_tokens": generated,
        "output_tokens_per_s": generated / seconds,
        "transformers": transformers.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=0.0, help="online mode: requests/s")
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = Engine.from_config(
        EngineConfig(
            model=args.model, backend=args.backend, max_num_seqs=256, max_num_batched_tokens=8192
        )
    )
    warm_up(engine)
    jobs = make_workload(
        args.requests,
        (args.min_len, args.max_len),
        (args.min_len, args.max_len),
        engine.model.config.vocab_size,
    )
    result = run_online(engine, jobs, args.rate) if args.rate else run_offline(engine, jobs)
    result.pop("token_ids", None)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
