"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn, the engine core behind them.

    POST /v1/chat/completions, POST /v1/completions   (stream: Server-Sent Events)
    POST /tokenize, /detokenize                        (vLLM's shapes)
    GET  /v1/models, /v1/models/{id}, /health (also HEAD), /metrics (Prometheus text)

Every connection's request goes into the same engine core (`EngineClient`: under `serve`, a
process of its own that batches all live requests continuously; engine_core.py). The handlers
render chat templates and tokenize in a worker thread and hand the core token ids; its token ids
come back per step and are detokenized here, so JSON, SSE and text never hold the core's GIL.
A small prompt is prepared on the event loop (a worker thread's hop cost more than its
tokenizing), a big one in a worker thread (prompts.py, INLINE_PROMPT_CHARS).
Errors are OpenAI-shaped, {"error": {"message", "type", "param", "code"}}: 400 bad JSON /
fields / token ids / prompt too long (code context_length_exceeded), 401 missing API key
(--api-key), 404 unknown model (model_not_found) or route, 408 body too slow, 413 body too
large, 429 queue full (queue_full, with Retry-After), 500 engine error, 503 engine stopped. 5xx
bodies carry the request id, never internal exception text (that goes to the server log). The
server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
from pathlib import Path

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ...engine import RequestRejected, SamplingParams
from ..core.engine_client import EngineClient, EngineUnavailable, QueueFull
from .chat_output import ParsedChatFormat
from .chat_tools import ChatParsers, plan_chat
from .connection import BodyGone, RequestContext, protocol_class, read_body
from .errors import APIError, validation_error
from .prompts import PromptPreparer
from .protocol import (
    IMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from .settings import ServerSettings
from .streaming import ChatFormat, CompletionFormat, EventStreamResponse, collect, sse_events

log = logging.getLogger("pagedkern.serving")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def served_model_name(spec: str | None) -> str:
    """The name clients pass as "model": the default model's, a file's or folder's stem, or
    the synthetic spec itself."""
    if spec is None:
        return "SmolLM2-135M-Instruct"
    if spec.startswith("synthetic:"):
        return spec
    return Path(spec).stem if spec.endswith(".gguf") else Path(spec).name


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed from a request cannot fail to
    encode (JSONResponse's UTF-8 encoding would raise on it)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return ASCIIJSONResponse(error.body(), status_code=error.status, headers=headers)


def create_app(
    loop: EngineClient, model_name: str | None = None, settings: ServerSettings | None = None
) -> FastAPI:
    """The app around an EngineClient; the app's lifespan attaches it to the event loop and
    stops the core (aborting what is still running) when the server shuts down."""
    settings = settings or ServerSettings()
    model_name = model_name or settings.served_model_name
    model_name = model_name or served_model_name(loop.info.model)
    max_model_len = loop.info.max_model_len
    vocab_size = loop.info.vocab_size
    tokenizer = loop.tokenizer
    prepare = PromptPreparer(tokenizer, max_model_len, vocab_size)
    loop.step_timeout = settings.step_timeout  # the step watchdog (engine_client.py)
    loop.stalled_request_timeout = settings.stalled_request_timeout

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await loop.aclose()

    app = FastAPI(title="pagedkern", lifespan=lifespan, default_response_class=ASCIIJSONResponse)
    app.state.engine_loop = loop
    app.state.model_name = model_name
    app.add_middleware(
        RequestContext, api_key=settings.api_key, max_header_bytes=settings.max_header_bytes
    )
    if settings.allowed_origins:  # outermost: preflight requests never need the API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(BodyGone)
    async def body_gone(http: Request, _exc: BodyGone) -> Response:
        log.debug("request %s: the client left before sending its body", request_id(http))
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(http: Request, exc: Exception) -> JSONResponse:
        log.error("request %s failed", request_id(http), exc_info=exc)
        return error_response(internal_error(request_id(http)))

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def parse_body(http: Request, schema: type):
        body = await read_body(http, settings.max_body_bytes, settings.body_timeout)
        return parse(schema, body)

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    async def generate(
        http: Request, prompts: list[dict], params, fmt, streaming: bool, echo: bool = False,
        grammar_param: str = "response_format",
    ) -> Response:  # fmt: skip
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
            loop.metrics.request_rejected(error.code or "invalid")
            raise error from exc
        streams = []
        try:
            for k, args in enumerate(prepared):
                sub = rid if len(prepared) == 1 else f"{rid}-p{k}"
                streams.append(await loop.submit(sub, args, params))
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
            texts = [a.get("prompt") or tokenizer.decode(a["prompt_ids"]) for a in prompts]
        body = await collect(streams, fmt, http, texts)
        return ASCIIJSONResponse(body) if body is not None else Response(status_code=499)

    # The two generation routes are plain Starlette routes: they read their own bodies and
    # return Responses, so FastAPI's per-request dependency solving bought them nothing.
    async def chat_completions(http: Request) -> Response:
        req = await parse_body(http, ChatCompletionRequest)
        check_model(req.model)
        params = sampling(req, max_model_len, settings.default_sampling, tokenizer, vocab_size)
        parsers = ChatParsers.of(tokenizer, settings)
        plan = plan_chat(req, params, parsers, settings)  # tools, reasoning (chat_tools.py)
        head = (f"chatcmpl-{request_id(http)}", model_name, req.include_usage, token_text, params.n)
        if plan.make_parser is None:
            fmt = ChatFormat(*head)
        else:
            fmt = ParsedChatFormat(*head, make_parser=plan.make_parser)
        prompt = {"messages": plan.messages}
        if plan.template_kwargs:
            prompt["template_kwargs"] = plan.template_kwargs
        return await generate(
            http, [prompt], plan.params, fmt, req.stream, grammar_param=plan.grammar_param
        )

    async def completions(http: Request) -> Response:
        req = await parse_body(http, CompletionRequest)
        check_model(req.model)
        params = sampling(
            req, COMPLETIONS_DEFAULT_MAX_TOKENS, settings.default_sampling, tokenizer, vocab_size
        )
        prompts = req.engine_prompts()
        if req.echo and req.stream:
            raise APIError(400, "echo with stream=true is not supported", param="echo")
        fmt = CompletionFormat(
            f"cmpl-{request_id(http)}", model_name, req.include_usage, token_text,
            params.n * len(prompts),
        )  # fmt: skip
        return await generate(http, prompts, params, fmt, req.stream, echo=req.echo)

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize(http: Request) -> dict:
        req = await parse_body(http, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            messages = [m.as_template_message() for m in req.messages]
            try:
                text = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt
                )
            except (ValueError, TypeError, jinja2.TemplateError) as exc:
                raise APIError(400, str(exc), param="messages") from exc
            ids = tokenizer.encode(text)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(http: Request) -> dict:
        req = await parse_body(http, DetokenizeRequest)
        check_model(req.model)
        for i, token in enumerate(req.tokens):
            if token >= vocab_size:
                raise APIError(400, f"tokens[{i}] = {token} is not a token id", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return ModelCard(id=model_name, max_model_len=max_model_len).model_dump()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if loop.alive and loop.stalled is None:
            return ASCIIJSONResponse({"status": "ok"})
        return error_response(unavailable(loop.stalled or "the engine is not running"))

    @app.get("/metrics")
    async def metrics() -> Response:
        text = loop.metrics.render(await loop.current_gauges(), model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def request_id(http: Request) -> str:
    """The request's id: its X-Request-Id header, or one made up by RequestContext."""
    return http.scope.get("state", {}).get("request_id") or "-"


def internal_error(request_id: str) -> APIError:
    return APIError(
        500,
        f"internal server error (request id {request_id}); the server log has the details",
        "server_error",
        code="internal_error",
    )


def unavailable(reason: str = "the engine is not running") -> APIError:
    return APIError(503, reason, "server_error", None, "engine_unavailable")


def admission_error(
    exc: Exception, param: str, request_id: str = "-", grammar_param: str = "response_format"
) -> APIError:
    """Why a request was refused before it ran, as an OpenAI error. Bad input (ValueError,
    TypeError, a template's refusal) is the client's 400; anything else is logged and a 500.
    A grammar the engine refused names grammar_param (tools, for a forced tool call's)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(
            429, f"too many requests queued: {exc}", "rate_limit_error", None, "queue_full"
        )
    if isinstance(exc, RequestRejected):  # longer than the context (or the whole KV cache)
        return APIError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, (ValueError, TypeError, jinja2.TemplateError)):
        if str(exc).startswith("response_format"):  # the core's grammar compile refused it
            param = grammar_param
        return APIError(400, str(exc), param=param)
    if isinstance(exc, EngineUnavailable):
        return unavailable(str(exc))
    log.error("request %s: admission failed", request_id, exc_info=exc)
    return internal_error(request_id)


def parse(model: type, body: bytes):
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise validation_error(exc) from exc


def sampling(
    req, default_max_tokens: int, defaults: dict | None = None, tokenizer=None, vocab_size=None
) -> SamplingParams:
    """The request's SamplingParams; a 400 naming the field for a bad value (SamplingParams'
    own checks), an unknown token id (logit_bias, allowed_token_ids, bad_words) or schema."""
    words = None
    if tokenizer is not None and req.bad_word_strings():
        words = [ids for w in req.bad_word_strings() for ids in bad_word_ids(tokenizer, w)]
    try:
        params = req.sampling_params(default_max_tokens, defaults or {}, words)
    except (ValueError, TypeError) as exc:  # SamplingParams' own checks
        raise APIError(400, str(exc), param=_field_named(str(exc))) from exc
    if vocab_size is not None:
        for name, token in params.token_ids_used():
            if not 0 <= token < vocab_size:
                raise APIError(
                    400, f"{name}: {token} is not a token id (vocabulary {vocab_size})", param=name
                )
    return params


def bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """The token sequences that ban `word` (vLLM's rule): the word at the start of the text and
    the word after a space, which a BPE tokenizer spells with other ids (" lazy" is not
    "lazy"). An empty or all-space word bans nothing."""
    word = word.lstrip()
    if not word:
        return []
    bare, spaced = tokenizer.encode(word), tokenizer.encode(" " + word)
    return [bare] if spaced == bare else [bare, spaced]


def _field_named(message: str) -> str | None:
    """The request field a SamplingParams error message starts with."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0].rstrip(":")
    return head if head in IMPLEMENTED else None


# --- running it --------------------------------------------------------------------------------


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening socket (port 0: a free one). Clients may connect before the server runs:
    the kernel queues them."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


class Server(uvicorn.Server):
    """uvicorn with the connection limits of `settings`, and a shutdown (Ctrl-C, SIGTERM,
    should_exit) that first tells the engine thread to abort what is running, so open streams
    end at once with finish_reason "abort" and `[DONE]` instead of waiting for uvicorn's
    graceful-shutdown timeout."""

    def __init__(self, app: FastAPI, settings: ServerSettings):
        config = uvicorn.Config(
            app,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            timeout_graceful_shutdown=5,
            http=protocol_class(settings.header_timeout, settings.write_timeout),
            timeout_keep_alive=settings.keep_alive_timeout,
            h11_max_incomplete_event_size=settings.max_header_bytes,
            # uvicorn refuses a request once connections (its own included) reach the limit
            limit_concurrency=settings.max_connections + 1,
        )
        super().__init__(config)
        self.engine_loop: EngineClient = app.state.engine_loop

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.request_stop()
        await super().shutdown(sockets)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # a requested stop: once it is done, exit with our status
            captured = getattr(self, "_captured_signals", [])  # (uvicorn re-raises them after
            while sig in captured:  # run(), and SIGTERM's default action kills the process)
                captured.remove(sig)


def serve(
    client: EngineClient,
    sock: socket.socket,
    settings: ServerSettings | None = None,
    *,
    on_listening=None,
) -> int:
    """Serve on a bound socket (see `bind`) until interrupted or the engine core dies; the exit
    status (0, or 1 after the core died). Ctrl-C / SIGTERM: running requests are aborted (open
    streams end with finish_reason "abort" and [DONE]), then uvicorn closes the connections (at
    most 5 s of grace). A dead core: open requests get their 503 / error event, then the same."""
    settings = settings or ServerSettings()
    app = create_app(client, settings=settings)
    server = Server(app, settings)
    died: list[str] = []

    def dead(reason: str) -> None:
        died.append(reason)
        server.should_exit = True

    client.on_dead = dead
    if on_listening is not None:
        on_listening(app.state.model_name, url_of(sock))
    try:
        server.run(sockets=[sock])
    finally:
        client.stop()  # the lifespan stopped it, unless uvicorn never started
    return 1 if died else 0


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
