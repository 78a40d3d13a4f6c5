"""A request's tools, tool_choice and tool history, checked: every refusal is a ToolSpecError
(a ValueError) naming the field, which the server turns into a 400.

    tools        [{"type": "function", "function": {"name", "description"?, "parameters"?,
                 "strict"?}}], at most `max_tools` and `max_bytes` of JSON
    tool_choice  "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    messages     assistant messages with tool_calls [{"id", "type": "function",
                 "function": {"name", "arguments": JSON text}}]; tool messages with the
                 tool_call_id of a call issued earlier in the conversation
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# OpenAI's rule for function names (fullmatch)
NAME_CHARS, MAX_NAME = "A-Za-z0-9_.-", 64
NAME = re.compile(f"[{NAME_CHARS}]{{1,{MAX_NAME}}}")
SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class ToolSpecError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict = field(hash=False)

    def as_tool(self) -> dict:
        """The HF / OpenAI tool shape chat templates expect."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def check_tools(tools: Any, max_tools: int, max_bytes: int) -> list[Function]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolSpecError("tools must be a list of function tools", "tools")
    if len(tools) > max_tools:
        raise ToolSpecError(f"at most {max_tools} tools per request, got {len(tools)}", "tools")
    size = len(json.dumps(tools))
    if size > max_bytes:
        raise ToolSpecError(f"tools has {size} bytes of JSON; at most {max_bytes}", "tools")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ToolSpecError(f"{where} must be {{'type': 'function', 'function': ...}}", where)
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolSpecError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolSpecError(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                f"got {name!r}",
                f"{where}.function.name",
            )
        if any(f.name == name for f in functions):
            raise ToolSpecError(f"two tools are named {name!r}", f"{where}.function.name")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolSpecError(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params, f"{where}.function.parameters", top=True)
        functions.append(Function(name, description, dict(params)))
    return functions


def check_schema(schema: Any, where: str, top: bool = False) -> None:
    """The JSON-schema shape checks that need no grammar engine (its own refusals come when a
    forced call's grammar compiles)."""
    if not isinstance(schema, Mapping):
        raise ToolSpecError(f"{where} must be a JSON schema object", where)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in SCHEMA_TYPES:
            raise ToolSpecError(f"{where}.type: {k!r} is not a JSON-schema type", f"{where}.type")
    if top and kind not in (None, "object"):
        raise ToolSpecError(f"{where} must describe an object (type 'object')", f"{where}.type")
    props = schema.get("properties", {})
    if not isinstance(props, Mapping):
        raise ToolSpecError(f"{where}.properties must be an object", f"{where}.properties")
    for key, sub in props.items():
        check_schema(sub, f"{where}.properties.{key}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolSpecError(f"{where}.required must be a list of names", f"{where}.required")
    if "items" in schema and isinstance(schema["items"], Mapping):
        check_schema(schema["items"], f"{where}.items")


def check_tool_choice(choice: Any, functions: list[Function]) -> ToolChoice:
    """The request's tool_choice (default: auto with tools, none without)."""
    if choice is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolSpecError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                "tool_choice",
            )
        if choice == "required" and not functions:
            raise ToolSpecError("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    name = None
    if isinstance(choice, Mapping) and choice.get("type", "function") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ToolSpecError(
            "tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice"
        )
    if all(f.name != name for f in functions):
        raise ToolSpecError(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
    return ToolChoice("named", name)


def check_history(messages: list[dict]) -> list[dict]:
    """The messages with their assistant tool calls' arguments decoded (the HF convention:
    templates write `arguments | tojson`) and every tool message answering an issued call."""
    issued: dict[str, str] = {}  # call id -> function name
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = []
            for k, call in enumerate(message["tool_calls"]):
                where = f"messages[{i}].tool_calls[{k}]"
                fn = call.get("function") if isinstance(call, Mapping) else None
                call_id = call.get("id") if isinstance(call, Mapping) else None
                if not isinstance(call_id, str) or not call_id:
                    raise ToolSpecError(f"{where}.id must be a non-empty string", f"{where}.id")
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ToolSpecError(f"{where}.function needs a name", f"{where}.function")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except (ValueError, RecursionError):  # (nested past Python's stack)
                        raise ToolSpecError(
                            f"{where}.function.arguments is not JSON (or nests too deeply)",
                            f"{where}.function.arguments",
                        ) from None
                issued[call_id] = fn["name"]
                calls.append(
                    {"id": call_id, "type": "function",
                     "function": {"name": fn["name"], "arguments": args}}
                )  # fmt: skip
            message["tool_calls"] = calls
        elif message["role"] == "tool":
            call_id = message.get("tool_call_id")
            where = f"messages[{i}].tool_call_id"
            if not isinstance(call_id, str) or not call_id:
                raise ToolSpecError(
                    f"{where}: a tool message needs the tool_call_id it answers", where
                )
            if call_id not in issued:
                raise ToolSpecError(
                    f"{where}: {call_id!r} answers no tool call of an earlier assistant message",
                    where,
                )
            message.setdefault("name", issued[call_id])
        out.append(message)
    return out
