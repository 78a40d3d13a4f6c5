"""`pagedkern-serve`: ask the model, watch the answer stream to stdout.

    pagedkern-serve "What is the capital of France?"
    pagedkern-serve --trace --temperature 0.7 --top-p 0.9 "法国的首都是哪里？"
    printf 'Hi\\n{"messages": [...], "max_tokens": 8}\\n' | pagedkern-serve -
    pagedkern-serve --http --port 8000    # OpenAI-compatible API on http://127.0.0.1:8000/v1

One prompt streams token by token. With `-`, every stdin line is a request (plain text, or a JSON
object with "prompt" or "messages" and sampling fields); they run together with continuous
batching and each answer is printed whole, in input order. With --http, the model is served
over an OpenAI-compatible HTTP API (chat and completions, SSE streaming, /metrics) until Ctrl-C.

Exit status: 0 done; 1 a request failed in the engine; 2 bad arguments or input (one line on
stderr; a bad stdin line is reported with its number and the other lines are still answered);
130 interrupted (Ctrl-C; what was generated so far is printed); 141 stdout closed early.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ...engine import Engine, FinishReason, RequestOutput, SamplingParams, ShadowDivergence
from ...processes import launcher_rank
from . import args as cli_args
from . import config_from_flags as from_flags
from .args import PROG

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
_HTTP_STACK = {
    "fastapi", "uvicorn", "pydantic", "pydantic_core", "starlette", "h11", "anyio", "msgpack"
}  # fmt: skip

build_parser = cli_args.build_parser


class BadInput(ValueError):
    """A request the CLI refuses before running it (-> one line on stderr, exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli_args.build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return _main(parser, args)
    except KeyboardInterrupt:  # the modes flushed what they had
        return 130
    except BrokenPipeError:  # e.g. `| head -c 5`: the reader is gone, say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail
        return 141


def _fail(message: object) -> NoReturn:
    _say(f"{PROG}: error: {message}")
    raise SystemExit(2)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.http and args.prompt is not None:
        parser.error("--http serves requests over HTTP: give no prompt")
    if not args.http and args.prompt is None:
        parser.error("a prompt (or '-' for stdin) is required")
    try:
        flags = from_flags.sampling_flags(args)  # (reads --json-schema FILE)
        defaults = {**cli_args.SAMPLING_DEFAULTS, **flags}
        _params(defaults)  # reject bad sampling flags before loading anything
        template = from_flags.chat_template(args.chat_template)
        settings = from_flags.server_settings(args) if args.http else None
        config = from_flags.engine_config(args)
        requests, bad_lines = [], 0
        if args.prompt == "-":
            requests, bad_lines = _read_stdin(args, defaults)
            if not requests:
                raise BadInput("no request on stdin to answer")
        single = None if args.http or requests else _prompt_args(args, args.prompt)
        # A taken port fails before the model loads; a launcher's rank > 0 serves no HTTP (it
        # becomes a TP worker inside Engine.from_config).
        sock = _bind(args) if args.http and launcher_rank() == 0 else None
    except (ValueError, TypeError, OSError) as exc:
        _fail(exc)

    if sock is not None:
        return _serve_http(args, config, template, sock, settings)
    try:
        engine = Engine.from_config(config)
    except Exception as exc:  # noqa: BLE001 - unknown model, no GPU for --backend cuda, ...
        _fail(exc)
    if template is not None:
        engine.tokenizer.chat_template = template
    if args.trace or args.stats:
        _say(f"pagedkern: {engine.describe()}")
    if args.trace:
        from ..core.trace import TraceWriter

        engine.tracer = TraceWriter(engine.tokenizer)
    try:
        status = _answer(engine, single, requests, defaults, args.stats)
    except ShadowDivergence as exc:  # --shadow=strict: the report says where, exit 1
        _say(str(exc))
        return 1
    if engine.shadow is not None:
        _say(engine.shadow.summary())
    return 2 if bad_lines and status == 0 else status


def _answer(engine: Engine, single, requests, defaults: dict, stats: bool) -> int:
    """Stream the one prompt of the command line, or answer the requests read from stdin."""
    if single is not None:
        try:
            status = _stream_one(engine, single, _params(defaults), stats)
        except (ValueError, TypeError) as exc:  # e.g. a prompt longer than the context
            _fail(exc)
    else:
        status = _run_many(engine, requests, stats)
    if stats and engine.config.speculative != "none":
        _say(_speculation_stats(engine))
    if stats and engine.stats().kv_blocks_by_kind:
        _say(_kv_kind_stats(engine))
    return status


def _params(fields: dict) -> SamplingParams:
    """The flags' and a stdin line's fields as SamplingParams, whose checks are the only ones
    (ValueError / TypeError naming the field: the line's error)."""
    return SamplingParams(**fields)


# --- stdin -------------------------------------------------------------------------------------


def _read_stdin(args, defaults: dict) -> tuple[list[tuple[int, dict, SamplingParams]], int]:
    """Every non-blank stdin line as (line number, add_request arguments, params); a bad line
    is reported on stderr (with its number) and skipped."""
    requests, bad = [], 0
    for number, raw in enumerate(sys.stdin.buffer.read().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            request_args, params = _request_args(args, line, defaults)
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # bad UTF-8,
            # JSON (nested past the recursion limit too), fields
            _say(f"{PROG}: error: stdin line {number}: {_reason(exc)}")
            bad += 1
            continue
        requests.append((number, request_args, params))
    return requests, bad


def _reason(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON: {exc}"
    if isinstance(exc, RecursionError):
        return "the JSON nests too deeply"
    return str(exc)


def _request_args(args, line: str, defaults: dict) -> tuple[dict, SamplingParams]:
    """A stdin line -> add_request arguments and its sampling parameters."""
    text = line.strip()
    if not text.startswith("{"):
        return _prompt_args(args, text), _params(defaults)
    item = json.loads(text)
    overrides = {k: item[k] for k in _JSON_FIELDS if k in item}
    params = _params({**defaults, **overrides})
    if "messages" in item:
        return {"messages": _messages(item["messages"])}, params
    prompt = item.get("prompt", "")
    if not isinstance(prompt, str):
        raise BadInput(f"prompt must be a string, got {type(prompt).__name__}")
    return _prompt_args(args, prompt), params


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadInput("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not all(
            isinstance(m.get(k), str) for k in ("role", "content")
        ):
            raise BadInput(f"messages[{i}] must have a string 'role' and a string 'content'")
    return messages


def _prompt_args(args, text: str) -> dict:
    if not text.strip():
        raise BadInput("the prompt is empty")
    if args.raw:
        return {"prompt": text}
    system = [{"role": "system", "content": args.system}] if args.system else []
    return {"messages": [*system, {"role": "user", "content": text}]}


# --- the three modes ---------------------------------------------------------------------------


def _bind(args):
    try:
        from ..http.app import bind
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] in _HTTP_STACK:
            raise BadInput(
                f"--http needs the HTTP serving stack ({exc.name} is not installed): "
                "pip install 'pagedkern[serve]'"
            ) from None
        raise
    return bind(args.host, args.port)


def _serve_http(args, config, template: str | None, sock, settings) -> int:
    """The front end in this process, the engine core in a child process (core_process.py);
    exit status 1 when the core died."""
    from ..core.core_process import EngineStartError, freeze_startup_objects
    from ..core.engine_client import EngineClient
    from ..http.app import serve

    try:
        client = EngineClient.spawn(
            config,
            trace=args.trace,
            log_level=args.log_level.upper(),
            core_threads=settings.core_threads,
        )
    except EngineStartError as exc:
        _fail(exc)
    if template is not None:
        client.tokenizer.chat_template = template
    if args.trace or args.stats:
        _say(f"pagedkern: {client.info.description}")

    def listening(model: str, url: str) -> None:
        _say(f"{PROG}: serving {model!r} at {url}/v1 (Ctrl-C stops)")

    freeze_startup_objects()
    status = 0
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        status = serve(client, sock, settings, on_listening=listening)
    return status


def _stats(output: RequestOutput) -> str:
    m = output.metrics
    parts = [f"{output.request_id}: {m.num_output_tokens} tokens"]
    if m.ttft is not None:
        parts.append(f"TTFT {m.ttft * 1e3:.1f} ms")
    if m.tpot is not None:
        parts.append(f"TPOT {m.tpot * 1e3:.1f} ms")
    if m.tokens_per_s:
        parts.append(f"{m.tokens_per_s:.1f} tokens/s")
    parts.append(f"finish {output.finish_reason.value if output.finish_reason else '?'}")
    return ", ".join(parts)


def _speculation_stats(engine: Engine) -> str:
    s = engine.stats()
    return (
        f"speculative {s.speculative}: {s.num_spec_proposed} proposed, "
        f"{s.num_spec_accepted} accepted ({s.spec_acceptance_rate:.1%}), "
        f"{s.spec_mean_accepted_length:.2f} accepted per step over {s.num_spec_steps} steps"
    )


def _kv_kind_stats(engine: Engine) -> str:
    """Per-kind block tables: the KV blocks each layer kind holds now and held at most."""
    s = engine.stats()
    kinds = ", ".join(f"{kind} {used} (peak {peak})" for kind, used, peak in s.kv_blocks_by_kind)
    return f"KV blocks in use per layer kind: {kinds}, of {s.num_blocks_total}"


def _logprob_line(engine: Engine, lp) -> str:
    def show(token_id: int, value: float) -> str:
        return f"{engine.tokenizer.decode([token_id])!r} {value:.4f}"

    top = "; ".join(show(t, v) for t, v in lp.top)
    return f"logprob {show(lp.token_id, lp.logprob)}" + (f" | top: {top}" if top else "")


def _stream_one(engine: Engine, request_args: dict, params: SamplingParams, stats: bool) -> int:
    output = None
    try:
        for output in engine.stream(params=params, **request_args):
            sys.stdout.write(output.text)
            sys.stdout.flush()
            for lp in output.logprobs or ():  # --logprobs N: one line per token on stderr
                _say(_logprob_line(engine, lp))
    finally:  # also on Ctrl-C: end the partial answer's line
        sys.stdout.write("\n")
        sys.stdout.flush()
    if stats and output is not None:
        _say(_stats(output))
    if output is None or output.finish_reason is FinishReason.ERROR:
        _say(f"{PROG}: error: generation failed: {output.error if output else '?'}")
        return 1
    return 0


def _run_many(engine: Engine, requests: list[tuple[int, dict, SamplingParams]], stats: bool) -> int:
    """Answers in input order; a line the engine refuses (too long, template error) is reported
    and skipped. Returns 1 if a request failed in the engine, 2 if a line was refused."""
    line_of: dict[str, int] = {}
    status = 0
    for number, request_args, params in requests:
        try:
            line_of[engine.add_request(params=params, **request_args).request_id] = number
        except Exception as exc:  # noqa: BLE001 - this line's fault: the others still run
            _say(f"{PROG}: error: stdin line {number}: {exc}")
            status = 2
    texts: dict[str, list[str]] = {i: [] for i in line_of}
    done: dict[str, RequestOutput] = {}
    try:
        for output in engine.run_until_done():
            texts[output.request_id].append(output.text)
            if output.finished:
                done[output.request_id] = output
    finally:  # also on Ctrl-C: what each answer has so far, in input order
        for request_id in line_of:
            print("".join(texts[request_id]), flush=True)
    for request_id, number in line_of.items():
        request = done[request_id]
        if stats:
            _say(_stats(request))
        if request.finish_reason is FinishReason.ERROR:
            _say(f"{PROG}: error: stdin line {number}: generation failed: {request.error}")
            status = 1
    return status
