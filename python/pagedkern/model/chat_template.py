"""Chat templates rendered the way HF's apply_chat_template does: a sandboxed jinja2 environment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a tojson filter that keeps
non-ASCII text, raise_exception and strftime_now globals, and the {% generation %} block.

A template comes with the model file, so it is untrusted: beyond the sandbox's own limits (no
attribute access to internals, one range() of at most 100000 items) its repeats ('x' * n),
powers and range() items in all are bounded per render, and a too deep recursion is a
TemplateError, not a RecursionError. (Loops over the request's own messages, or string
doubling by `~`, are not bounded here.)"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

Message = Mapping[str, Any]
# The most items one repeat may make and range() calls may give in one render, and the most
# bits of a power's result
MAX_ITEMS = 1_000_000
MAX_POWER_BITS = 65536


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                repeat = isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                if repeat and len(seq) * n > MAX_ITEMS:
                    raise SecurityError(f"a repeat of more than {MAX_ITEMS} items")
        elif ints and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise SecurityError(f"a power of more than {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


def _budgeted_range() -> Any:
    """A range() for one render: the sandbox's, with MAX_ITEMS items over all its calls."""
    left = [MAX_ITEMS]

    def budgeted(*args: int) -> range:
        items = range(*args)
        left[0] -= len(items)
        if left[0] < 0:
            raise SecurityError(f"range() gave more than {MAX_ITEMS} items in one render")
        return items

    return budgeted


class _GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for HF's training masks;
    rendering just emits the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [], [], None, None)
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's filter: unlike jinja2's built-in one it neither escapes HTML nor forces ASCII.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with `template`.

    Variables: messages, tools, documents, add_generation_prompt, the special-token strings
    (bos_token, eos_token, ...) and any extra keyword (e.g. enable_thinking). With
    continue_final_message the text ends right after the last message's content, so the model
    continues it (exclusive with add_generation_prompt, as in HF).
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are exclusive")
    variables = {**(special_tokens or {}), "range": _budgeted_range(), **kwargs}
    try:
        rendered = compile_template(template).render(
            messages=list(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except RecursionError:  # (a macro calling itself, or deeply nested parentheses)
        raise jinja2.TemplateError("the chat template recurses too deeply") from None
    if continue_final_message:
        final = messages[-1]["content"]
        if not isinstance(final, str):  # multimodal content list: its last text part
            final = next(p["text"] for p in reversed(final) if p.get("type") == "text")
        final = final.strip()
        if final not in rendered:
            raise ValueError("the final message's content does not appear in the rendered chat")
        rendered = rendered[: rendered.rindex(final) + len(final)]
    return rendered
