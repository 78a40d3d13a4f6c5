"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn, one engine thread behind them.

    POST /v1/chat/completions, POST /v1/completions   (stream: Server-Sent Events)
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text)

Every connection's request goes into the same engine (`EngineLoop`: one thread owns it and
batches all live requests continuously). Errors are OpenAI-shaped, {"error": {"message",
"type", "param", "code"}}: 400 bad JSON / fields / prompt too long (code
context_length_exceeded), 404 unknown model (model_not_found) or route, 429 queue full
(queue_full, with Retry-After), 500 engine error, 503 engine stopped. The server keeps serving
after any of them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import uuid
from pathlib import Path

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine, RequestRejected, SamplingParams
from .engine_loop import EngineLoop, EngineUnavailable, QueueFull
from .errors import APIError, validation_error
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
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


def create_app(loop: EngineLoop, model_name: str) -> FastAPI:
    """The app around a (possibly not yet started) EngineLoop; the app's lifespan starts it
    and stops it (aborting what is still running) when the server shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="pagedkern", lifespan=lifespan)
    app.state.engine_loop = loop
    max_model_len = loop.engine.max_model_len  # fixed at construction: safe to read here

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(error.body(), status_code=exc.status_code)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def generate(http: Request, args: dict, params, fmt, streaming: bool) -> Response:
        try:
            stream = await loop.submit(fmt.meta["id"], args, params)
        except Exception as exc:  # noqa: BLE001 - every admission failure gets its status
            raise admission_error(exc, "messages" if "messages" in args else "prompt") from exc
        if streaming:
            return EventStreamResponse(sse_events(stream, fmt), on_close=stream.close)
        body = await collect(stream, fmt, http)
        return JSONResponse(body) if body is not None else Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        req = parse(ChatCompletionRequest, await http.body())
        check_model(req.model)
        params = sampling(req, max_model_len)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", model_name, req.include_usage)
        messages = [m.as_template_message() for m in req.messages]
        return await generate(http, {"messages": messages}, params, fmt, req.stream)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        req = parse(CompletionRequest, await http.body())
        check_model(req.model)
        params = sampling(req, COMPLETIONS_DEFAULT_MAX_TOKENS)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", model_name, req.include_usage)
        return await generate(http, req.engine_prompt(), params, fmt, req.stream)

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return ModelCard(id=model_name, max_model_len=max_model_len).model_dump()

    @app.get("/health")
    async def health() -> Response:
        if loop.alive:
            return JSONResponse({"status": "ok"})
        error = APIError(
            503, "the engine is not running", "server_error", None, "engine_unavailable"
        )
        return JSONResponse(error.body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            gauges = await loop.call(lambda _engine: loop.gauges())
        except EngineUnavailable:
            gauges = None
        text = loop.metrics.render(gauges, model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def admission_error(exc: Exception, param: str) -> APIError:
    """Why the engine thread refused a request, as an OpenAI error."""
    if isinstance(exc, QueueFull):
        return APIError(
            429, f"too many requests queued: {exc}", "rate_limit_error", None, "queue_full"
        )
    if isinstance(exc, RequestRejected):  # longer than the context (or the whole KV cache)
        return APIError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, (ValueError, jinja2.TemplateError)):  # empty prompt, template refusal
        return APIError(400, str(exc), param=param)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), "server_error", None, "engine_unavailable")
    log.error("admission failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def parse(model: type, body: bytes):
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise validation_error(exc) from exc


def sampling(req, default_max_tokens: int) -> SamplingParams:
    try:
        return req.sampling_params(default_max_tokens)
    except ValueError as exc:  # SamplingParams' own checks
        raise APIError(400, str(exc)) from exc


# --- running it --------------------------------------------------------------------------------


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening socket (port 0: a free one). Clients may connect before the server runs:
    the kernel queues them."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


class _Server(uvicorn.Server):
    """uvicorn, but a shutdown (Ctrl-C, SIGTERM, should_exit) first tells the engine thread to
    abort what is running, so open streams end at once with finish_reason "abort" and
    `[DONE]` instead of waiting for uvicorn's graceful-shutdown timeout."""

    def __init__(self, app: FastAPI, log_level: str):
        config = uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=5, access_log=log_level == "debug"
        )
        super().__init__(config)
        self.engine_loop: EngineLoop = app.state.engine_loop

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.request_stop()
        await super().shutdown(sockets)


def serve(
    engine: Engine,
    sock: socket.socket,
    *,
    max_queue: int | None = None,  # None: engine.config.max_queue
    model_name: str | None = None,
    log_level: str = "warning",
    on_listening=None,
) -> None:
    """Serve on a bound socket (see `bind`) until interrupted. Ctrl-C / SIGTERM: running requests
    are aborted (open streams end with finish_reason "abort" and [DONE]), then uvicorn closes
    the connections (at most 5 s of grace)."""
    name = model_name or served_model_name(engine.config.model)
    app = create_app(EngineLoop(engine, max_queue=max_queue), name)
    if on_listening is not None:
        on_listening(name, url_of(sock))
    _Server(app, log_level).run(sockets=[sock])


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ServerThread:
    """The server in a background thread of this process (tests, benchmarks, notebooks):

    with ServerThread(engine, max_queue=8) as server:
        openai.OpenAI(base_url=server.url + "/v1", api_key="-")...
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int | None = None,  # None: engine.config.max_queue
        model_name: str | None = None,
        after_step=None,
    ):
        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.model_name = model_name or served_model_name(engine.config.model)
        self.engine_loop = EngineLoop(engine, max_queue=max_queue, after_step=after_step)
        self.app = create_app(self.engine_loop, self.model_name)
        self.server = _Server(self.app, "warning")
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.sock]},
            name="pagedkern-http",
            daemon=True,
        )

    def start(self) -> ServerThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine_loop.stop()  # in case the lifespan never ran
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
