"""From `pagedkern-serve`'s parsed flags (args.py) to what they configure: the EngineConfig,
the ServerSettings, the sampling defaults given, the chat template. Each raises ValueError
naming the flag for a value it cannot use."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ...engine import EngineConfig, engine_fields
from ..http.settings import ServerSettings
from .args import SAMPLING_DEFAULTS, field_default


def sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling flags given explicitly (None: not given)."""
    given = {
        name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) is not None
    }
    if args.stop:
        given["stop"] = list(args.stop)
    if args.json_schema:
        given["response_format"] = json_schema_format(args.json_schema)
    return given


def json_schema_format(path: str) -> dict:
    """--json-schema FILE as a response_format (ValueError naming the flag if unreadable)."""
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from None
    return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema}}


def _derived_engine_values(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name, f in engine_fields().items() if f.cli is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError for a combination EngineConfig refuses, and for a --device this
    machine does not have."""
    import torch

    return EngineConfig(
        model=args.model,
        device=check_device(args.device),
        dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        kv_per_kind_tables=not args.no_kv_per_kind_tables,
        max_queue=args.max_queue,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        cuda_graphs=False if args.enforce_eager else field_default(EngineConfig, "cuda_graphs"),
        **_derived_engine_values(args),
    )


def check_device(value: str | None) -> str | None:
    """--device as given, if torch can place tensors there: a CUDA device needs a GPU that torch
    sees (else the model's loading would fail with torch's long message on its CUDA library)."""
    if value is None:
        return None
    import torch

    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"--device {value}: {exc}") from None
    if device.type != "cuda":
        return value
    if not torch.cuda.is_available():
        build = "; this torch is built without CUDA" if torch.version.cuda is None else ""
        raise ValueError(
            f"--device {value}: no CUDA GPU is visible (torch.cuda.is_available() is False{build})"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"--device {value}: no such GPU (torch sees {count}: cuda:0..cuda:{count - 1})"
        )
    return value


def server_settings(args: argparse.Namespace) -> ServerSettings:
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    return ServerSettings(
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes,
        max_connections=args.max_connections,
        max_seqs_per_request=args.max_seqs_per_request,
        write_buffer_bytes=args.write_buffer_bytes,
        write_timeout=args.write_timeout,
        step_timeout=args.step_timeout,
        stalled_request_timeout=args.stalled_request_timeout,
        core_threads=args.core_threads,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_tools=args.max_tools,
        max_tools_bytes=args.max_tools_bytes,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        allowed_origins=origins,
        default_sampling=sampling_flags(args),
        log_level=args.log_level,
    )


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it is a template.
    ValueError for a missing file or a template Jinja cannot parse."""
    if value is None:
        return None
    path = Path(value)
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline:
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {path}: {exc}") from None
    import jinja2

    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return value
