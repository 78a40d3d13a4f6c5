"""OpenAI API responses (the subset pagedkern serves) as pydantic models, and the mapping of
the engine's finish reasons to OpenAI's. The streamed chunks' hot path writes the same JSON
without the models (body_formats.py)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from ...engine import FinishReason


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    """stop -> "stop"; max_tokens, the context length and the request's time budget -> "length"
    (the answer was cut by a limit); a cancelled request -> "abort" (vLLM's word; only seen
    when the server shuts down, a disconnected client sees nothing). Errors are not a finish
    reason: they become a 500 (or an error event in a stream)."""
    if reason is None:
        return None
    return {
        FinishReason.STOP: "stop",
        FinishReason.LENGTH: "length",
        FinishReason.CONTEXT: "length",
        FinishReason.TIMEOUT: "length",
        FinishReason.ABORT: "abort",
    }.get(reason, "error")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class AssistantMessage(BaseModel):
    """content is null when the answer is only tool calls; tool_calls and reasoning_content
    are left out when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        body = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if body.get(key) is None:
                body.pop(key, None)
        return body


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A chunk's delta: absent keys are left out ({} on the closing chunk), as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: dict | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict | None = None


class Completion(_Response):
    """Both the whole answer and each streamed chunk (OpenAI uses one schema for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkern"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
