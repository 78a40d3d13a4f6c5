"""Chat templates render as HF's apply_chat_template does (its jinja environment's details)."""

from __future__ import annotations

import jinja2
import pytest
from jinja2.exceptions import SecurityError

from pagedkern.model.chat_template import render_chat

USER = [{"role": "user", "content": "法国的首都是哪里？"}]

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def test_llama3_template_with_special_tokens():
    text = render_chat(
        LLAMA3,
        [{"role": "user", "content": "  Hi  "}],
        add_generation_prompt=True,
        special_tokens={"bos_token": "<|begin_of_text|>"},
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_trim_and_lstrip_blocks():
    template = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
        "{% endif %}\n{% endfor %}"
    )
    assert render_chat(template, USER * 2) == "[法国的首都是哪里？]\n[法国的首都是哪里？]\n"


def test_raise_exception():
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(jinja2.TemplateError, match="system first"):
        render_chat(template, USER)


def test_tojson_keeps_non_ascii():
    template = "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}"
    tools = [{"name": "weather"}]
    text = render_chat(template, USER, tools=tools)
    assert text.startswith('{"role": "user", "content": "法国的首都是哪里？"}|')
    assert '\n  {\n    "name": "weather"\n  }\n' in text


def test_loop_controls_generation_block_and_kwargs():
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "{{ strftime_now('%Y')|length }}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(template, messages, enable_thinking=False) == "<a>/no_think4"


def test_sandbox_is_immutable():
    with pytest.raises(SecurityError):
        render_chat("{{ messages.append(1) }}", USER)


def test_continue_final_message():
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [*USER, {"role": "assistant", "content": "巴黎 is"}]
    text = render_chat(template, messages, continue_final_message=True)
    assert text == "<user>法国的首都是哪里？</s>\n<assistant>巴黎 is"
    with pytest.raises(ValueError):
        render_chat(template, messages, add_generation_prompt=True, continue_final_message=True)
