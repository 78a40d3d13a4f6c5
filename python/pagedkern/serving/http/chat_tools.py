"""A chat request's tools, tool_choice, chat_template_kwargs and reasoning, turned into what
the rest of the route uses: the chat template's inputs, the SamplingParams (with the grammar
that forces tool_choice "required" / a named function, or puts response_format after the
thinking) and the parser each choice's answer goes through. Refusals are 400s naming the
field (serving/tools/spec.py)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from ...engine import SamplingParams
from ..tools import (
    ReasoningParser,
    ToolParser,
    reasoning_parser_for_template,
    reasoning_parser_named,
    template_handles_tools,
    tool_parser_for_template,
    tool_parser_named,
)
from ..tools.grammar import after_thinking, tool_call_grammar
from ..tools.output import ChatOutputParser
from ..tools.prompting import template_inputs
from ..tools.reasoning import ThinkingGrammar
from ..tools.spec import ToolSpecError, check_history, check_tool_choice, check_tools
from .errors import APIError
from .request_models import ChatCompletionRequest
from .settings import ServerSettings

# Template variables a request may not set through chat_template_kwargs (the server's own).
RESERVED_TEMPLATE_VARIABLES = frozenset(
    ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "chat_template", "tokenize", "special_tokens")
)  # fmt: skip


@dataclass(slots=True)
class ChatPlan:
    messages: list[dict]
    template_kwargs: dict  # tools=..., chat_template_kwargs
    params: SamplingParams
    make_parser: Callable[[], ChatOutputParser] | None  # None: the answer is plain content
    grammar_param: str | None  # the field a grammar the engine refuses is blamed on


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """The server's parser families (settings, else what the chat template shows)."""

    template: str | None
    tool_parser: type[ToolParser]
    reasoning: type[ReasoningParser] | None
    thinking: ThinkingGrammar | None  # the reasoning's grammar for this tokenizer
    encode: Callable[[str], list[int]]  # the tokenizer's (a tag that is one token: by id)

    @classmethod
    def of(cls, tokenizer, settings: ServerSettings) -> ChatParsers:
        """(Cached per tokenizer, template and flags: every chat request asks.)"""
        return _parsers(
            tokenizer, tokenizer.chat_template, settings.tool_call_parser, settings.reasoning_parser
        )

    @classmethod
    def make(
        cls, tokenizer, template: str | None, tool_parser: str | None, reasoning_parser: str | None
    ) -> ChatParsers:
        tool_name = tool_parser or tool_parser_for_template(template)
        reasoning_name = reasoning_parser or reasoning_parser_for_template(template)
        reasoning = reasoning_parser_named(reasoning_name) if reasoning_name else None
        thinking = ThinkingGrammar.of(reasoning, tokenizer.encode) if reasoning else None
        return cls(template, tool_parser_named(tool_name), reasoning, thinking, tokenizer.encode)


@functools.lru_cache(maxsize=16)
def _parsers(tokenizer, template, tool_parser, reasoning_parser) -> ChatParsers:
    return ChatParsers.make(tokenizer, template, tool_parser, reasoning_parser)


def plan_chat(
    req: ChatCompletionRequest, params: SamplingParams, parsers: ChatParsers,
    settings: ServerSettings,
) -> ChatPlan:  # fmt: skip
    try:
        functions = check_tools(req.tools, settings.max_tools, settings.max_tools_bytes)
        if req.tool_choice is not None and not functions and req.tool_choice != "none":
            raise ToolSpecError("tool_choice needs tools", "tool_choice")
        choice = check_tool_choice(req.tool_choice, functions)
        messages = check_history([m.as_template_message() for m in req.messages])
    except ToolSpecError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    parallel = req.parallel_tool_calls
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    parallel = True if parallel is None else parallel
    kwargs = dict(req.chat_template_kwargs or {})
    if reserved := RESERVED_TEMPLATE_VARIABLES & set(kwargs):
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
            param="chat_template_kwargs",
        )
    handles = template_handles_tools(parsers.template)
    # a template that renders tools speaks its family's markup; the generic format otherwise
    tool_parser = parsers.tool_parser if handles else tool_parser_named("generic")
    messages, tools = template_inputs(messages, functions, choice, parallel, handles)
    if tools:
        kwargs["tools"] = tools
    reasoning, thinking = parsers.reasoning, parsers.thinking
    if reasoning is not None and reasoning.starts_inside and kwargs.get("enable_thinking") is False:
        reasoning = thinking = None  # the template closed the thinking in the prompt
    grammar_param = "response_format"
    if choice.forced:
        if params.response_format is not None:
            raise APIError(
                400,
                "response_format cannot be combined with a forced tool_choice",
                param="response_format",
            )
        fmt = tool_call_grammar(
            tool_parser, functions, choice, parallel, thinking, encode=parsers.encode
        )
        grammar_param = "tools"
        try:  # (a grammar past the size bound: the forced tools' schemas are too big)
            params = dataclasses.replace(params, response_format=fmt)
        except ValueError as exc:
            reason = str(exc).removeprefix("response_format: ")
            raise APIError(
                400, f"tools: too big for a forced call ({reason})", param="tools"
            ) from exc
    elif thinking is not None and params.response_format is not None:
        fmt = after_thinking(params.response_format, thinking)
        try:
            params = dataclasses.replace(params, response_format=fmt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from exc
    parse_tools = tool_parser if choice.mode != "none" and functions else None
    make_parser = None
    if parse_tools is not None or reasoning is not None:

        def make_parser() -> ChatOutputParser:
            return ChatOutputParser(reasoning, parse_tools)

    return ChatPlan(messages, kwargs, params, make_parser, grammar_param)
