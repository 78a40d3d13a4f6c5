"""Tool calling and reasoning output for the OpenAI-compatible server: the request's tools
checked (spec.py), the prompt rendered with them (prompting.py), forced calls as a grammar
(grammar.py), and the answer split into reasoning, content and tool calls as it streams
(output.py) by one parser per family (hermes.py, llama3.py, mistral.py, generic.py,
reasoning.py). No HTTP here: serving/http uses it."""

from __future__ import annotations

from .base import Parsed, ToolCall, ToolParser
from .generic import GenericJsonToolParser
from .hermes import HermesToolParser
from .llama3 import Llama3JsonToolParser
from .mistral import MistralToolParser
from .reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser_for_template

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, GenericJsonToolParser)
}
# Other names the families go by (vLLM's parser names where they differ).
ALIASES = {"qwen": "hermes", "qwen2_5": "hermes", "qwen3": "hermes", "llama3": "llama3_json"}


def tool_parser_named(name: str) -> type[ToolParser]:
    key = ALIASES.get(name, name)
    if key not in TOOL_PARSERS:
        names = ", ".join(sorted({*TOOL_PARSERS, *ALIASES}))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {names})")
    return TOOL_PARSERS[key]


def template_handles_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (HF convention); otherwise the generic
    format describes them (prompting.py)."""
    return bool(template) and "tools" in template


def tool_parser_for_template(template: str | None) -> str:
    """The family a chat template shows by its own markup; generic when it handles no tools."""
    if not template_handles_tools(template):
        return "generic"
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral")):
        if marker in template:
            return name
    if "<|python_tag|>" in template or "parameters" in template:
        return "llama3_json"
    return "generic"


def reasoning_parser_named(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})")
    return REASONING_PARSERS[name]


__all__ = [
    "ALIASES",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Parsed",
    "ReasoningParser",
    "ToolCall",
    "ToolParser",
    "reasoning_parser_for_template",
    "reasoning_parser_named",
    "template_handles_tools",
    "tool_parser_for_template",
    "tool_parser_named",
]
