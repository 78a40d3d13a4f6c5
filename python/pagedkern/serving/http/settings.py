"""The HTTP server's settings, with their defaults in one place (the CLI's `--http` flags derive
their defaults and help text from these fields, as the engine flags do from EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tools import reasoning_parser_named, tool_parser_named


def _opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(slots=True)
class ServerSettings:
    max_body_bytes: int = _opt(8 * 2**20, "largest request body accepted, in bytes (413 beyond)")
    body_timeout: float = _opt(30.0, "seconds a client may take to send a request body (408)")
    header_timeout: float = _opt(10.0, "seconds a connection may take to send request headers")
    keep_alive_timeout: int = _opt(5, "seconds an idle keep-alive connection stays open")
    max_header_bytes: int = _opt(64 * 1024, "largest request head (request line and headers)")
    max_connections: int = _opt(1024, "open connections (and running handlers) before a 503")
    max_seqs_per_request: int = _opt(
        256, "sequences one request may ask for (n x prompts) before a 400"
    )
    write_buffer_bytes: int = _opt(
        16 * 2**20,
        "bytes of a streamed response's events its client may leave untaken before the "
        "stream is aborted and the connection closed",
    )
    write_timeout: float = _opt(
        30.0, "seconds a connection may take no data while a response waits before it is closed"
    )
    step_timeout: float = _opt(
        60.0, "seconds without a completed engine step, while requests wait, before /health is 503"
    )
    stalled_request_timeout: float = _opt(
        120.0, "seconds without a completed engine step before the open requests fail (503)"
    )
    served_model_name: str | None = _opt(None, "the model name clients pass (default: derived)")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer <key>' on /v1 routes")
    allowed_origins: list[str] = _opt(None, "CORS origins allowed ('*': any; default: none)")
    default_sampling: dict = _opt(
        None, "sampling fields used when a request leaves them out (CLI sampling flags)"
    )
    log_level: str = _opt("warning", "server log level (debug also logs every request)")
    tool_call_parser: str | None = _opt(
        None,
        "how tool calls are read from answers: hermes (Qwen2.5/Qwen3), llama3_json, mistral or "
        "generic; unset: chosen by the chat template's own markup (generic for a template "
        "without tools)",
    )
    reasoning_parser: str | None = _opt(
        None,
        "moves <think>...</think> into reasoning_content: qwen3 or deepseek_r1; unset: chosen "
        "by the chat template (none when it has no <think>)",
    )
    max_tools: int = _opt(128, "function tools one request may carry (400 beyond)")
    max_tools_bytes: int = _opt(256 * 1024, "bytes of JSON a request's tools may take (400 beyond)")
    core_threads: int | None = _opt(
        None,
        "torch intra-op threads of a CPU engine core; auto: every core this process may use, "
        "less one left to the front end when the model costs less CPU per token than the "
        "front end does (core_process.core_threads)",
    )

    def __post_init__(self) -> None:
        self.allowed_origins = list(self.allowed_origins or [])
        self.default_sampling = dict(self.default_sampling or {})
        positive = {
            "max_body_bytes": self.max_body_bytes,
            "body_timeout": self.body_timeout,
            "header_timeout": self.header_timeout,
            "keep_alive_timeout": self.keep_alive_timeout,
            "max_header_bytes": self.max_header_bytes,
            "max_connections": self.max_connections,
            "max_seqs_per_request": self.max_seqs_per_request,
            "write_buffer_bytes": self.write_buffer_bytes,
            "write_timeout": self.write_timeout,
            "step_timeout": self.step_timeout,
            "stalled_request_timeout": self.stalled_request_timeout,
            "max_tools": self.max_tools,
            "max_tools_bytes": self.max_tools_bytes,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
            if value == float("inf"):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.core_threads is not None and (
            isinstance(self.core_threads, bool)
            or not isinstance(self.core_threads, int)
            or self.core_threads < 1
        ):
            raise ValueError(f"core_threads must be a positive integer, got {self.core_threads!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None:
            tool_parser_named(self.tool_call_parser)  # ValueError naming the known ones
        if self.reasoning_parser is not None:
            reasoning_parser_named(self.reasoning_parser)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
