"""The JSON bodies of one request's OpenAI response, in OpenAI's shapes: the chunks of a stream
(`chat.completion.chunk` / `text_completion`) and the whole answer of a non-streaming one.

Chat streams open with a role chunk, as OpenAI's do; the last text delta carries the finish
reason; with stream_options.include_usage every chunk has `"usage": null` and a final chunk
with empty choices carries the usage.

Several prompts (completions) and n samples each are one response: choice index = prompt
index x n + sample index; usage counts every prompt once and every completion's tokens.
Logprobs, when asked for: chat `logprobs.content[] = {token, logprob, bytes, top_logprobs}`,
completions `{tokens, token_logprobs, top_logprobs, text_offset}`. A completions top_logprobs
entry is a map from token text to logprob, so tokens that decode alike (byte pieces of one
character, say) share a key: the likeliest keeps it. With `return_tokens_as_token_ids` (vLLM's
field) every token is named `token_id:<id>` instead, which never collides; `bytes` and
text_offset still follow the token's text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from ..core.request_stream import StreamOutput
from .response_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    Usage,
)

# A format's delta may be several chunks (chat_output.py: a tool call's two), joined by this,
# or "" for none: streaming.py's event() of the joined text is then their events.
CHUNK_SEPARATOR = "\n\ndata: "


class _Format:
    """Response bodies for one request: `opening` (streams only), `delta` per streamed text,
    `usage` (the last chunk with stream_options.include_usage), `whole` (non-streaming).
    token_text(id) -> the token's text, for logprobs."""

    chunk_type: type
    whole_type: type

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        token_text: Callable[[int], str] = str,
        num_choices: int = 1,
        tokens_as_ids: bool = False,
    ):
        self.include_usage = include_usage
        self.token_text = token_text
        self.tokens_as_ids = tokens_as_ids
        self.num_choices = num_choices
        self.offsets = [0] * num_choices  # completions' text_offset per choice
        # one id and timestamp for every chunk of the response
        self.meta = {"id": request_id, "created": int(time.time()), "model": model}

    @property
    def meta(self) -> dict:
        return self._meta

    @meta.setter
    def meta(self, meta: dict) -> None:
        """Also the JSON around every chunk's choice, encoded once per response."""
        self._meta = meta
        head = compact_json({**meta, "object": self.chunk_object})
        self._head = head[:-1] + ',"choices":['
        self._tail = '],"usage":null}' if self.include_usage else "]}"

    def opening(self) -> str | None:
        return None

    def delta(self, index: int, out: StreamOutput, finish_reason: str | None) -> str:
        """One chunk's JSON: the per-token hot path of a stream, so the text around the choice
        is encoded once per response and the choice is formatted from its few values (a
        pydantic model per token cost ~5x more, json.dumps of the chunk ~3x); the same bytes as
        `chunk_type(...).model_dump_json` (tests/test_http_processes.py checks)."""
        logprobs = self.logprobs(index, out)
        choice = self._choice(
            index,
            json_string(out.text),
            "null" if finish_reason is None else json_string(finish_reason),
            "null" if logprobs is None else compact_json(logprobs),
            bool(out.text),
        )
        return f"{self._head}{choice}{self._tail}"

    def usage(self, usage: Usage) -> str:
        return self.chunk_type(**self.meta, choices=[], usage=usage).model_dump_json()

    def whole(self, choices: list[tuple[str, str | None, dict | None]], usage: Usage) -> dict:
        built = [self._whole_choice(i, *c) for i, c in enumerate(choices)]
        return self.whole_type(**self.meta, choices=built, usage=usage).model_dump()

    def _entry(self, token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        """(the token as shown, its logprob for JSON, its text's UTF-8 bytes)."""
        text = self.token_text(token_id)
        shown = f"token_id:{token_id}" if self.tokens_as_ids else text
        return shown, _finite(logprob), list(text.encode("utf-8", "replace"))

    def _top_map(self, top) -> dict[str, float]:
        """Completions' {token: logprob} of the alternatives (likeliest first): a token that
        shows as an earlier one's text does not overwrite it."""
        out: dict[str, float] = {}
        for t, v in top:
            shown, logprob, _ = self._entry(t, v)
            out.setdefault(shown, logprob)
        return out


# what json.dumps(ensure_ascii=False) writes for a str
json_string = json.encoder.encode_basestring


def compact_json(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _finite(value: float) -> float:
    """JSON has no -inf: a token of probability 0 gets the most negative float (as vLLM's
    -9999.0 stand-in, but exact in ordering)."""
    return value if value > -float("inf") else -9999.0


class ChatFormat(_Format):
    chunk_type, whole_type = ChatCompletionChunk, ChatCompletion
    chunk_object = "chat.completion.chunk"

    def opening(self) -> str | None:
        choices = [
            ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
            for i in range(self.num_choices)
        ]
        chunk = ChatCompletionChunk(**self.meta, choices=choices)
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def logprobs(self, index: int, out: StreamOutput) -> dict | None:
        if out.logprobs is None:
            return None
        content = []
        for lp in out.logprobs:
            token, logprob, raw = self._entry(lp.token_id, lp.logprob)
            top = []
            for t, v in lp.top:
                t_text, t_lp, t_raw = self._entry(t, v)
                top.append({"token": t_text, "logprob": t_lp, "bytes": t_raw})
            content.append({"token": token, "logprob": logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str, logprobs: str, has_text: bool) -> str:
        """ChatChunkChoice's JSON from its values' JSON (no content key without text)."""
        delta = f'{{"content":{text}}}' if has_text else "{}"
        return (
            f'{{"index":{index},"delta":{delta},"finish_reason":{finish_reason},'
            f'"logprobs":{logprobs}}}'
        )

    def _whole_choice(self, index, text, finish_reason, logprobs):
        return ChatChoice(
            index=index, message=AssistantMessage(content=text), finish_reason=finish_reason,
            logprobs=logprobs,
        )  # fmt: skip

    @staticmethod
    def merge_logprobs(parts: list[dict]) -> dict | None:
        return {"content": [c for p in parts for c in p["content"]]} if parts else None


class CompletionFormat(_Format):
    chunk_type = whole_type = Completion
    chunk_object = "text_completion"

    def logprobs(self, index: int, out: StreamOutput) -> dict | None:
        if out.logprobs is None:
            return None
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in out.logprobs:
            token, logprob, _ = self._entry(lp.token_id, lp.logprob)
            body["tokens"].append(token)
            body["token_logprobs"].append(logprob)
            body["top_logprobs"].append(self._top_map(lp.top))
            body["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(self.token_text(lp.token_id))
        return body

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str, logprobs: str, has_text: bool) -> str:
        """CompletionChoice's JSON from its values' JSON."""
        return (
            f'{{"index":{index},"text":{text},"finish_reason":{finish_reason},'
            f'"logprobs":{logprobs}}}'
        )

    def _whole_choice(self, index, text, finish_reason, logprobs):
        return CompletionChoice(
            index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
        )

    @staticmethod
    def merge_logprobs(parts: list[dict]) -> dict | None:
        if not parts:
            return None
        return {key: [v for p in parts for v in p[key]] for key in parts[0]}

    def with_prompt_logprobs(
        self, prompt: tuple | None, echoed: str, generated: dict | None
    ) -> dict | None:
        """echo + logprobs: the prompt's tokens first (the first token has no logprob: None, as
        OpenAI), then the generated ones, their text_offset shifted past the echoed prompt."""
        if prompt is None:
            return generated
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token_id, lp in zip(*prompt, strict=True):
            body["tokens"].append(self._entry(token_id, 0.0)[0])
            body["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
            body["top_logprobs"].append(None if lp is None else self._top_map(lp.top))
            body["text_offset"].append(offset)
            offset += len(self.token_text(token_id))
        for key, values in (generated or {}).items():
            shift = len(echoed) if key == "text_offset" else None
            body[key] += [v + shift for v in values] if shift is not None else values
        return body


Format = ChatFormat | CompletionFormat
