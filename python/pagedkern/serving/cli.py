"""`pagedkern-serve`: ask the model, watch the answer stream to stdout.

    pagedkern-serve "What is the capital of France?"
    pagedkern-serve --trace --temperature 0.7 --top-p 0.9 "法国的首都是哪里？"
    printf 'Hi\\n{"messages": [...], "max_tokens": 8}\\n' | pagedkern-serve -
    pagedkern-serve --http --port 8000    # OpenAI-compatible API on http://127.0.0.1:8000/v1

One prompt streams token by token. With `-`, every stdin line is a request (plain text, or a JSON
object with "prompt" or "messages" and sampling fields); they run together with continuous
batching and each answer is printed whole, in input order. With --http, the model is served
over an OpenAI-compatible HTTP API (chat and completions, SSE streaming, /metrics) until Ctrl-C.
Bad arguments exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence

from ..engine import Engine, EngineConfig, FinishReason, Request, SamplingParams

_JSON_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "timeout",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkern-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", help="the question; '-' reads one request per stdin line")
    p.add_argument("--model", help="GGUF file, HF folder or synthetic:<preset> (default SmolLM2)")
    p.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto")
    p.add_argument("--system", help="system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    p.add_argument("--stats", action="store_true", help="TTFT, TPOT, tokens/s on stderr")
    p.add_argument("--trace", action="store_true", help="narrate each request's life on stderr")
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int)
    g.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size on the CPU")
    g.add_argument("--no-prefix-caching", action="store_true")
    # Quantization (issue 14): weight-only int8/int4, fp8 KV cache, fixed-length runs.
    g.add_argument(
        "--quantization",
        choices=("none", "int8", "int4"),
        help="weights (default: the model's measured best)",
    )
    g.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: E4M3 K/V"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens, past EOS")
    h = p.add_argument_group("http (--http)")
    h.add_argument("--http", action="store_true", help="serve the OpenAI-compatible HTTP API")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    h.add_argument(
        "--max-queue", type=int, default=256, help="waiting requests before 429 (default 256)"
    )
    return p


def _params(args, overrides: dict | None = None) -> SamplingParams:
    fields = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )
    fields.update(overrides or {})
    return SamplingParams(**fields)


def _request_args(args, line: str) -> tuple[dict, SamplingParams]:
    """A stdin line -> add_request arguments and its sampling parameters."""
    text = line.strip()
    if text.startswith("{"):
        item = json.loads(text)
        overrides = {k: item[k] for k in _JSON_FIELDS if k in item}
        if "messages" in item:
            return {"messages": item["messages"]}, _params(args, overrides)
        return _prompt_args(args, str(item.get("prompt", ""))), _params(args, overrides)
    return _prompt_args(args, text), _params(args)


def _prompt_args(args, text: str) -> dict:
    if not text.strip():
        raise ValueError("the prompt is empty")
    if args.raw:
        return {"prompt": text}
    system = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": [*system, {"role": "user", "content": text}]}


def _stats(request: Request) -> str:
    m = request.metrics()
    parts = [f"{request.request_id}: {m['num_output_tokens']} tokens"]
    if m["ttft"] is not None:
        parts.append(f"TTFT {m['ttft'] * 1e3:.1f} ms")
    if m["tpot"] is not None:
        parts.append(f"TPOT {m['tpot'] * 1e3:.1f} ms")
    if m["tokens_per_s"]:
        parts.append(f"{m['tokens_per_s']:.1f} tokens/s")
    parts.append(f"finish {request.finish_reason.value if request.finish_reason else '?'}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.http:
        if args.prompt is not None:
            parser.error("--http serves requests over HTTP: give no prompt")
        if not 0 <= args.port <= 65535 or args.max_queue < 1:
            parser.error("--port must be in 0..65535 and --max-queue >= 1")
    elif args.prompt is None:
        parser.error("a prompt (or '-' for stdin) is required")
    try:
        _params(args)  # reject bad sampling flags before loading anything
        lines = sys.stdin.read().splitlines() if args.prompt == "-" else None
        requests = [_request_args(args, line) for line in lines if line.strip()] if lines else None
        if lines is not None and not requests:
            raise ValueError("no prompts on stdin")
        single = None if requests or args.http else _prompt_args(args, args.prompt)
        sock = _bind(args) if args.http else None  # a taken port fails before the model loads
    except (ValueError, json.JSONDecodeError, OSError) as exc:
        parser.exit(2, f"pagedkern-serve: error: {exc}\n")

    config = EngineConfig(
        model=args.model,
        backend=args.backend,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    try:
        engine = Engine.from_config(config)
    except Exception as exc:  # noqa: BLE001 - unknown model, no GPU for --backend cuda, ...
        parser.exit(2, f"pagedkern-serve: error: {exc}\n")
    if args.trace or args.stats:
        print(f"pagedkern: {engine.describe()}", file=sys.stderr)
    if args.trace:
        from .trace import TraceWriter

        engine.tracer = TraceWriter(engine.tokenizer)
    if sock is not None:
        return _serve_http(engine, sock, args.max_queue)
    try:
        if single is not None:
            return _stream_one(engine, single, _params(args), args.stats)
        return _run_many(engine, requests, args.stats)
    except ValueError as exc:  # e.g. a prompt longer than the context
        parser.exit(2, f"pagedkern-serve: error: {exc}\n")


def _bind(args):
    from .http_server import bind

    return bind(args.host, args.port)


def _serve_http(engine: Engine, sock, max_queue: int) -> int:
    from .http_server import serve

    def listening(model: str, url: str) -> None:
        print(f"pagedkern-serve: serving {model!r} at {url}/v1 (Ctrl-C stops)", file=sys.stderr)
        sys.stderr.flush()

    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        serve(engine, sock, max_queue=max_queue, on_listening=listening)
    return 0


def _stream_one(engine: Engine, request_args: dict, params: SamplingParams, stats: bool) -> int:
    output = None
    for output in engine.stream(params=params, **request_args):
        sys.stdout.write(output.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if stats and output is not None:
        print(_stats(output.request), file=sys.stderr)
    return 1 if output is None or output.finish_reason is FinishReason.ERROR else 0


def _run_many(engine: Engine, requests: list[tuple[dict, SamplingParams]], stats: bool) -> int:
    ids = [engine.add_request(params=p, **a).request_id for a, p in requests]
    texts = {i: [] for i in ids}
    done: dict[str, Request] = {}
    for output in engine.run_until_done():
        texts[output.request_id].append(output.text)
        if output.finished:
            done[output.request_id] = output.request
    for request_id in ids:
        print("".join(texts[request_id]), flush=True)
        if stats:
            print(_stats(done[request_id]), file=sys.stderr)
    return 1 if any(r.finish_reason is FinishReason.ERROR for r in done.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
