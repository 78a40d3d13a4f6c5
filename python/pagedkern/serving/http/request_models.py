"""OpenAI API requests (the subset pagedkern serves) as pydantic models, and the mapping from a
request to the engine's SamplingParams (its errors: 400s naming the field).

Requests are parsed strictly (`"max_tokens": "8"` or `true` is a 400, an int where a float is
expected is fine; floats must be finite). The pydantic models check the JSON's shape and types
only: the values' ranges are SamplingParams' to check, once, with the same messages as for the
CLI and Python (`sampling_params` builds it; a ValueError naming the field is a 400 with that
`param`). Every OpenAI field is in exactly one of three lists:
IMPLEMENTED (mapped to SamplingParams or the response), UNSUPPORTED (known, would change the
answer's meaning: a 400 naming the field when set) and everything else (unknown: ignored, as vLLM
does).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ...engine import SamplingParams
from .errors import APIError

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # /detokenize's (no SamplingParams there)
# Fields a server-wide default (the CLI's sampling flags) fills in when a request leaves them out.
DEFAULTABLE = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty",
    "logprobs", "response_format",
)  # fmt: skip
# The three lists (README, "HTTP server"): implemented fields ...
IMPLEMENTED = (
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options",
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "top_logprobs", "min_tokens", "response_format", "allowed_token_ids", "bad_words", "echo",
    "user", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "return_tokens_as_token_ids",
)  # fmt: skip
# ... known but not implemented (a 400 naming the field when set to anything but its default) ...
UNSUPPORTED = (
    "functions", "function_call", "best_of",
    "suffix", "audio", "modalities", "prediction", "web_search_options", "prompt_logprobs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "use_beam_search",
)  # fmt: skip
# (tools, tool_choice and parallel_tool_calls are chat fields: /v1/completions refuses them,
# whatever their value.)
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")
# ... and everything else is unknown and ignored.
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message of the conversation; content may be null or left out only on an assistant
    message with tool_calls. tool_calls and tool_call_id are checked in serving/tools/spec.py."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None

    @field_validator("content")
    @classmethod
    def _content_present(cls, content, info):
        if content is None and not (
            info.data.get("role") == "assistant" and info.data.get("tool_calls")
        ):
            raise PydanticCustomError("missing", "Field required")
        return content

    def as_template_message(self) -> dict:
        content = self.content
        text = (
            content
            if isinstance(content, str) or content is None
            else "".join(p.text for p in content)
        )
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


class _SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (plus vLLM's extras top_k,
    ignore_eos and stop_token_ids, which load generators use for fixed output lengths)."""

    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0 (OpenAI clients send -1): off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | list[list[int]] = []
    response_format: dict | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens `token_id:<id>`
    tools: Any = None  # (a chat field: spec.py checks it; refused by /v1/completions)
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # Known fields with no implementation: kept only to be refused (any non-default value).
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    prompt_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: Any = None

    def unsupported(self) -> dict[str, Any]:
        """Set fields whose meaning the engine does not implement (-> 400)."""
        found = {}
        for name in UNSUPPORTED:
            value = getattr(self, name, None)
            if value not in (None, False, [], {}) and not (name == "best_of" and value == 1):
                found[name] = value
        return found

    def num_logprobs(self) -> int | None:
        """None (no logprobs) or the number of top alternatives per token."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self,
        default_max_tokens: int,
        defaults: dict | None = None,
        bad_word_ids: list[list[int]] | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams (their checks are the request's: ValueError / TypeError
        naming the field); `defaults` (the server's) fill the DEFAULTABLE fields this request
        did not set; bad_word_ids: the server's tokenization of bad_word_strings()."""
        for name, value in self.unsupported().items():
            raise APIError(400, f"'{name}'={value!r} is not supported", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        if isinstance(self.response_format, dict) and self.response_format.get("type") == "grammar":
            # (the engine's Lark form is the server's own, for tool calls and thinking)
            raise APIError(
                400,
                "response_format.type must be one of 'text', 'json_object', 'json_schema'",
                param="response_format",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields = dict(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.num_logprobs(),
            response_format=self.response_format,
        )
        for name, value in (defaults or {}).items():
            if name in DEFAULTABLE and not self._sets(name):
                fields[name] = value
        return SamplingParams(
            **fields,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=[w for w in self.bad_words if not isinstance(w, str)] + (bad_word_ids or []),
            prompt_logprobs=self.num_prompt_logprobs(),
        )

    def num_prompt_logprobs(self) -> int | None:
        """None, or the number of top alternatives per prompt token (echo with logprobs)."""
        return None

    def bad_word_strings(self) -> list[str]:
        """bad_words given as text (vLLM's form): tokenized by the server."""
        return [w for w in self.bad_words if isinstance(w, str)]

    def _sets(self, name: str) -> bool:
        return name in self.model_fields_set and getattr(self, name) is not None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    max_completion_tokens: int | None = None  # newer name of max_tokens
    logprobs: bool = False
    # (bounded here: SamplingParams' error would name its own field, logprobs)
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int, defaults=None, bad_word_ids=None):
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:  # (one would be ignored)
            raise APIError(
                400,
                f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                f"({self.max_completion_tokens}) disagree: send one",
                param="max_completion_tokens",
            )
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens  # counts as set (model_fields_set)
        return super().sampling_params(default_max_tokens, defaults, bad_word_ids)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]  # (ids: PromptPreparer checks them)
    echo: bool = False
    logprobs: int | None = None

    def unsupported(self) -> dict[str, Any]:
        # a chat field means nothing here, whatever its value (`[]` and false too)
        chat = {name: getattr(self, name) for name in CHAT_ONLY if getattr(self, name) is not None}
        return {**super().unsupported(), **chat}

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None  # the prompt's tokens get logprobs too

    def engine_prompts(self) -> list[dict]:
        """add_request arguments per prompt: {"prompt": text} or {"prompt_ids": ids}."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        out = []
        for one in prompts:
            if isinstance(one, str):
                out.append({"prompt": one})
            elif not one:
                raise APIError(400, "the prompt is empty", param="prompt")
            else:
                out.append({"prompt_ids": list(one)})
        return out


MAX_PROMPTS = 64


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: {"model", "prompt"} or {"model", "messages"}."""

    model_config = _STRICT
    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str
    tokens: list[TokenId]
