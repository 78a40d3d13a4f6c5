"""Chat templates rendered the way HF's apply_chat_template does: a sandboxed jinja2 environment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a tojson filter that keeps
non-ASCII text, raise_exception and strftime_now globals, and the {% generation %} block."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


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
    env = ImmutableSandboxedEnvironment(
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
    variables = {**(special_tokens or {}), **kwargs}
    rendered = compile_template(template).render(
        messages=list(messages),
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if continue_final_message:
        final = messages[-1]["content"]
        if not isinstance(final, str):  # multimodal content list: its last text part
            final = next(p["text"] for p in reversed(final) if p.get("type") == "text")
        final = final.strip()
        if final not in rendered:
            raise ValueError("the final message's content does not appear in the rendered chat")
        rendered = rendered[: rendered.rindex(final) + len(final)]
    return rendered
