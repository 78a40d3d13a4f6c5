"""Load generator for any OpenAI-compatible server, in the style of vLLM's benchmark_serving:
requests arrive as a Poisson process at --request-rate (inf: all at once), each one streams
(SSE), and the run reports request throughput, output tokens/s and TTFT / TPOT / ITL / E2E
latency (mean, median, p99).

    pagedkern-serve --http --port 8000 &
    python bench/load_generator.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --request-rate 4 --input-len 64 --output-len 32 --ignore-eos

TTFT: request sent -> first chunk with text. ITL: gaps between chunks with text. TPOT: (E2E -
TTFT) / (output tokens - 1). Output tokens come from the server's usage (stream_options.
include_usage), else from the number of text chunks. --ignore-eos sends vLLM's `ignore_eos`
extra so every answer has exactly --output-len tokens (servers that reject unknown fields:
leave it off). Prompts are synthetic (--input-len words drawn with --seed) or one per line of
--prompts-file (plain text, or JSON with "prompt" or "messages").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

WORDS = (  # noqa: SIM905 - one line of words reads better than a 30-line list
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact river mountain city music garden"
).split()


@dataclass
class Outcome:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(args) -> list[dict]:
    """Request bodies' prompt parts: {"messages": [...]} (chat) or {"prompt": "..."}."""
    if args.prompts_file:
        items = []
        with open(args.prompts_file, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    item = json.loads(line) if line.lstrip().startswith("{") else line.strip()
                    items.append(item)
        texts = [items[i % len(items)] for i in range(args.num_prompts)]
    else:
        rng = random.Random(args.seed)
        texts = [
            " ".join(rng.choice(WORDS) for _ in range(args.input_len))
            for _ in range(args.num_prompts)
        ]
    prompts = []
    for item in texts:
        if isinstance(item, dict) and "messages" in item and args.endpoint == "chat":
            prompts.append({"messages": item["messages"]})
            continue
        text = item.get("prompt", "") if isinstance(item, dict) else item
        key = {"messages": [{"role": "user", "content": text}]} if args.endpoint == "chat" else None
        prompts.append(key or {"prompt": text})
    return prompts


async def one_request(http: httpx.AsyncClient, url: str, body: dict, chat: bool) -> Outcome:
    start = time.perf_counter()
    out = Outcome(ok=False)
    last = None
    chunks = 0
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                out.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message"))
                    return out
                now = time.perf_counter()
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    out.output_tokens = chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices") or []:
                    text = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if text:
                        chunks += 1
                        if last is None:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks
    out.ok = last is not None
    if not out.ok:
        out.error = "no text received"
    return out


async def run(args) -> dict:
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get(base + "/v1/models")).json()["data"][0]["id"]
        chat = args.endpoint == "chat"
        url = base + ("/v1/chat/completions" if chat else "/v1/completions")
        rng = random.Random(args.seed)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(body: dict) -> Outcome:
            if gate is None:
                return await one_request(http, url, body, chat)
            async with gate:
                return await one_request(http, url, body, chat)

        tasks = []
        start = time.perf_counter()
        for prompt in make_prompts(args):
            body = {
                "model": model,
                **prompt,
                "max_tokens": args.output_len,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.ignore_eos:
                body["ignore_eos"] = True
            tasks.append(asyncio.ensure_future(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(outcomes, duration, model, args)


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict:
    ms = sorted(v * 1e3 for v in values) or [0.0]
    result = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms)}
    for p in percentiles:  # linear interpolation between ranks, as numpy.percentile
        k = (len(ms) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ms) - 1)
        result[f"p{p:g}_{name}_ms"] = ms[lo] + (ms[hi] - ms[lo]) * (k - lo)
    return result


def summarize(outcomes: list[Outcome], duration: float, model: str, args) -> dict:
    good = [o for o in outcomes if o.ok]
    output = sum(o.output_tokens for o in good)
    prompt = sum(o.prompt_tokens for o in good)
    pct = [float(p) for p in args.percentiles.split(",")]
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in good if o.output_tokens > 1]
    result = {
        "model": model,
        "endpoint": args.endpoint,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "completed": len(good),
        "failed": len(outcomes) - len(good),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(good) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        **_stats("ttft", [o.ttft for o in good], pct),
        **_stats("tpot", tpot, pct),
        **_stats("itl", [x for o in good for x in o.itl], pct),
        **_stats("e2el", [o.latency for o in good], pct),
    }
    return result


def report(result: dict) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Request rate (req/s)", result["request_rate"]),
        ("Benchmark duration (s)", result["duration_s"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    for name, label in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append((f"-- {label} --", None))
        rows += [
            (k.replace(f"_{name}_ms", "").replace("_", " ").title() + f" {name.upper()} (ms)", v)
            for k, v in result.items()
            if k.endswith(f"_{name}_ms")
        ]
    for label, value in rows:
        if value is None:
            lines.append("{s:{c}^60}".format(s=f" {label.strip('- ')} ", c="-"))
        elif isinstance(value, float):
            lines.append(f"{label:<44}{value:>16.2f}")
        else:
            lines.append(f"{label:<44}{value!s:>16}")
    for error in result["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", help="default: the first model the server lists")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf: at once")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=64, help="words per synthetic prompt")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    p.add_argument("--prompts-file", help="one prompt per line (text or JSON)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--result-json", help="write the result here")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.request_rate <= 0 or args.output_len < 1:
        raise SystemExit("--num-prompts, --request-rate and --output-len must be positive")
    result = asyncio.run(run(args))
    print(report(result))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if outcome["failed"] else 0)
