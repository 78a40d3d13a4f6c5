"""The OpenAI-compatible endpoints over one EngineClient (app.py registers them).

The generation handlers render chat templates and tokenize (a small prompt on the event loop,
a big one in a worker thread: prompts.py, INLINE_PROMPT_CHARS; /tokenize and /detokenize
likewise) and hand the core token ids; its token ids come back per step and are rendered here
(body_formats.py, streaming.py), so JSON, SSE and text never hold the core's GIL.
"""

from __future__ import annotations

import asyncio

import jinja2
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from ..core.engine_client import EngineClient
from ..tools import template_handles_tools
from ..tools.prompting import template_inputs
from ..tools.spec import ToolChoice, ToolSpecError, check_history
from .body_formats import ChatFormat, CompletionFormat
from .chat_output import ParsedChatFormat
from .chat_tools import ChatParsers, plan_chat
from .connection import read_body, request_id
from .error_mapping import ASCIIJSONResponse, admission_error, error_response, unavailable
from .errors import APIError
from .event_stream_response import EventStreamResponse
from .prompts import PromptPreparer
from .request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .request_parsing import parse_off_the_loop, sampling
from .response_models import ModelCard, ModelList
from .settings import ServerSettings
from .streaming import sse_events
from .whole_response import collect

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIRoutes:
    """The handlers, each a method, sharing the client, the served name, the settings and the
    tokenizer."""

    def __init__(self, client: EngineClient, model_name: str, settings: ServerSettings):
        self.client = client
        self.model_name = model_name
        self.settings = settings
        self.max_model_len = client.info.max_model_len
        self.vocab_size = client.info.vocab_size
        self.tokenizer = client.tokenizer
        self.prepare = PromptPreparer(self.tokenizer, self.max_model_len, self.vocab_size)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def parse_body(self, http: Request, schema: type):
        body = await read_body(http, self.settings.max_body_bytes, self.settings.body_timeout)
        return await parse_off_the_loop(schema, body)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    async def generate(
        self, http: Request, prompts: list[dict], params, fmt, streaming: bool,
        echo: bool = False, grammar_param: str = "response_format",
    ) -> Response:  # fmt: skip
        """Prepare the prompts, submit one stream per prompt, and answer with their SSE
        events or, collected, one JSON body."""
        settings, client, prepare = self.settings, self.client, self.prepare
        rid = request_id(http)
        param = "messages" if "messages" in prompts[0] else "prompt"
        if params.n * len(prompts) > settings.max_seqs_per_request:
            raise APIError(
                400,
                f"n x prompts = {params.n} x {len(prompts)} sequences; this server runs at most "
                f"{settings.max_seqs_per_request} for one request",
                param="n",
            )
        try:  # template + tokens, off the engine; a big one off the event loop too
            if prepare.is_small(prompts):
                prepared = [prepare(args) for args in prompts]
            else:
                prepared = [await asyncio.to_thread(prepare, args) for args in prompts]
        except Exception as exc:  # noqa: BLE001 - every refusal gets its status
            error = admission_error(exc, param, rid)
            client.metrics.request_rejected(error.code or "invalid")
            raise error from exc
        streams = []
        try:
            if len(prepared) == 1:
                streams.append(await client.submit(rid, prepared[0], params))
            else:  # each prompt its own engine request, rid in use until all have ended
                client.check_free(rid)
                for k, args in enumerate(prepared):
                    streams.append(await client.submit(f"{rid}-p{k}", args, params, group=rid))
        except Exception as exc:  # noqa: BLE001 - every admission failure gets its status
            for stream in streams:
                stream.close()
            raise admission_error(exc, param, rid, grammar_param) from exc
        if streaming:
            return EventStreamResponse(
                lambda writer: sse_events(streams, fmt, writer, settings.write_buffer_bytes),
                on_close=lambda: [s.close() for s in streams],
            )
        texts = None
        if echo:
            decode = self.tokenizer.decode
            texts = [a.get("prompt") or decode(a["prompt_ids"]) for a in prompts]
        body = await collect(streams, fmt, http, texts)
        return ASCIIJSONResponse(body) if body is not None else Response(status_code=499)

    # The two generation routes are plain Starlette routes: they read their own bodies and
    # return Responses, so FastAPI's per-request dependency solving bought them nothing.
    async def chat_completions(self, http: Request) -> Response:
        req = await self.parse_body(http, ChatCompletionRequest)
        self.check_model(req.model)
        settings = self.settings
        params = await sampling(
            req, self.max_model_len, settings.default_sampling, self.tokenizer, self.vocab_size
        )
        parsers = ChatParsers.of(self.tokenizer, settings)
        plan = plan_chat(req, params, parsers, settings)  # tools, reasoning (chat_tools.py)
        head = (
            f"chatcmpl-{request_id(http)}", self.model_name, req.include_usage, self.token_text,
            params.n, req.return_tokens_as_token_ids,
        )  # fmt: skip
        if plan.make_parser is None:
            fmt = ChatFormat(*head)
        else:
            fmt = ParsedChatFormat(*head, make_parser=plan.make_parser)
        prompt = {"messages": plan.messages}
        if plan.template_kwargs:
            prompt["template_kwargs"] = plan.template_kwargs
        return await self.generate(
            http, [prompt], plan.params, fmt, req.stream, grammar_param=plan.grammar_param
        )

    async def completions(self, http: Request) -> Response:
        req = await self.parse_body(http, CompletionRequest)
        self.check_model(req.model)
        params = await sampling(
            req, COMPLETIONS_DEFAULT_MAX_TOKENS, self.settings.default_sampling, self.tokenizer,
            self.vocab_size,
        )  # fmt: skip
        prompts = req.engine_prompts()
        if req.echo and req.stream:
            raise APIError(400, "echo with stream=true is not supported", param="echo")
        fmt = CompletionFormat(
            f"cmpl-{request_id(http)}", self.model_name, req.include_usage, self.token_text,
            params.n * len(prompts), req.return_tokens_as_token_ids,
        )  # fmt: skip
        return await self.generate(http, prompts, params, fmt, req.stream, echo=req.echo)

    async def tokenize(self, http: Request) -> dict:
        req = await self.parse_body(http, TokenizeRequest)
        self.check_model(req.model)
        tokenizer = self.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            args = {"messages": self.chat_messages(req.messages)}
        else:
            args = {"prompt": req.prompt}

        def tokens() -> list[int]:
            if "prompt" in args:
                return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            try:
                text = tokenizer.apply_chat_template(
                    args["messages"], add_generation_prompt=req.add_generation_prompt
                )
            except (ValueError, TypeError, jinja2.TemplateError) as exc:
                raise APIError(400, str(exc), param="messages") from exc
            return tokenizer.encode(text)

        # (no length limit: clients count a long text's tokens here; a big one off the loop)
        ids = tokens() if self.prepare.is_small([args]) else await asyncio.to_thread(tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict]:
        """The messages as the chat route gives them to the template (no tools): the same
        checks (a 400 naming the field), so /tokenize counts that route's prompt."""
        try:
            checked = check_history([m.as_template_message() for m in messages])
        except ToolSpecError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        handles = template_handles_tools(self.tokenizer.chat_template)
        return template_inputs(checked, [], ToolChoice("none"), True, handles)[0]

    async def detokenize(self, http: Request) -> dict:
        req = await self.parse_body(http, DetokenizeRequest)
        self.check_model(req.model)

        def text() -> str:
            for i, token in enumerate(req.tokens):
                if token >= self.vocab_size:
                    raise APIError(400, f"tokens[{i}] = {token} is not a token id", param="tokens")
            return self.tokenizer.decode(req.tokens)

        small = self.prepare.is_small([{"prompt_ids": req.tokens}])
        return {"prompt": text() if small else await asyncio.to_thread(text)}

    async def models(self) -> dict:
        card = ModelCard(id=self.model_name, max_model_len=self.max_model_len)
        return ModelList(data=[card]).model_dump()

    async def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return ModelCard(id=self.model_name, max_model_len=self.max_model_len).model_dump()

    async def health(self) -> Response:
        client = self.client
        if client.alive and client.stalled is None:
            return ASCIIJSONResponse({"status": "ok"})
        return error_response(unavailable(client.stalled or "the engine is not running"))

    async def metrics(self) -> Response:
        client = self.client
        text = client.metrics.render(await client.current_gauges(), self.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
