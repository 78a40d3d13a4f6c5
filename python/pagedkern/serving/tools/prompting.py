"""The chat template's inputs for a request with tools.

A template that renders tools itself (HF convention: it reads `tools`, assistant messages'
`tool_calls` and `tool` messages) gets them as they are. For one that does not (the default
SmolLM2's, ChatML-only), the generic format, after llama.cpp's generic handler:

- the system turn (the first one, or a new one) ends with the tools' descriptions and schemas
  and the instruction to answer a call as one JSON object,
      {"tool_calls": [{"name": "<tool>", "arguments": {...}}]}
  (generic.py parses it; grammar.py enforces it for tool_choice required or named);
- an assistant turn's earlier calls are written back in that same JSON;
- tool results become a user turn, `{"tool_response": {"id", "name", "content"}}` per result
  (several results in a row share one turn), since such templates know no `tool` role.
"""

from __future__ import annotations

import json

from .spec import Function, ToolChoice

INSTRUCTIONS = (
    "You can call these tools; each one's arguments follow its JSON schema:\n{tools}\n"
    "To call tools, answer with only this JSON object and nothing else:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}\n'
    "{choice}"
)
CHOICE = {
    "auto": "Otherwise, answer the user directly in plain text.",
    "required": "You must call at least one tool now.",
    "named": "You must call the tool {name} now.",
    "none": "Do not call tools now; answer the user directly in plain text.",
}


def generic_system_text(functions: list[Function], choice: ToolChoice, parallel: bool) -> str:
    described = [
        {"name": f.name, "description": f.description or "", "parameters": f.parameters}
        for f in functions
    ]
    rule = CHOICE[choice.mode].format(name=choice.name)
    if not parallel:
        rule += " Call at most one tool at a time."
    return INSTRUCTIONS.format(tools=json.dumps(described, ensure_ascii=False), choice=rule)


def template_inputs(
    messages: list[dict],
    functions: list[Function],
    choice: ToolChoice,
    parallel: bool,
    handles_tools: bool,
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template."""
    if handles_tools:
        tools = [f.as_tool() for f in functions] or None
        return [_for_template(m) for m in messages], tools
    out: list[dict] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in message["tool_calls"]
            ]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            before = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{before}\n{text}" if before else text})
        elif message["role"] == "tool":
            result = {
                "tool_response": {
                    "id": message["tool_call_id"],
                    "name": message.get("name"),
                    "content": message.get("content") or "",
                }
            }
            text = json.dumps(result, ensure_ascii=False)
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    for message in out:
        message.pop("_tool_results", None)
    if functions:
        system = generic_system_text(functions, choice, parallel)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _for_template(message: dict) -> dict:
    out = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out
