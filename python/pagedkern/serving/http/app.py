"""The OpenAI-compatible HTTP server: FastAPI routes on uvicorn, the engine core behind them.

    POST /v1/chat/completions, POST /v1/completions   (stream: Server-Sent Events)
    POST /tokenize, /detokenize                        (vLLM's shapes)
    GET  /v1/models, /v1/models/{id}, /health (also HEAD), /metrics (Prometheus text)

Every connection's request goes into the same engine core (`EngineClient`: under `serve`, a
process of its own that batches all live requests continuously; engine_core.py). This module
assembles the app (the middleware, the error handlers of error_mapping.py, the route table of
routes.py's handlers) and serves it (server.py's uvicorn). Errors are OpenAI-shaped, {"error":
{"message", "type", "param", "code"}}: 400 bad JSON / fields / token ids / prompt too long
(code context_length_exceeded), 401 missing API key (--api-key), 404 unknown model
(model_not_found) or route, 408 body too slow, 413 body too large, 429 queue full (queue_full,
with Retry-After), 500 engine error, 503 engine stopped. The server keeps serving after any of
them.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from ..core.engine_client import EngineClient
from .connection import RequestContext
from .error_mapping import ASCIIJSONResponse, admission_error, install_error_handlers
from .routes import OpenAIRoutes
from .server import Server, bind, url_of
from .settings import ServerSettings

__all__ = ["Server", "admission_error", "bind", "create_app", "serve", "url_of"]


def served_model_name(spec: str | None) -> str:
    """The name clients pass as "model": the default model's, a file's or folder's stem, or
    the synthetic spec itself."""
    if spec is None:
        return "SmolLM2-135M-Instruct"
    if spec.startswith("synthetic:"):
        return spec
    return Path(spec).stem if spec.endswith(".gguf") else Path(spec).name


def create_app(
    loop: EngineClient, model_name: str | None = None, settings: ServerSettings | None = None
) -> FastAPI:
    """The app around an EngineClient; the app's lifespan attaches it to the event loop and
    stops the core (aborting what is still running) when the server shuts down."""
    settings = settings or ServerSettings()
    model_name = model_name or settings.served_model_name
    model_name = model_name or served_model_name(loop.info.model)
    loop.watchdog.step_timeout = settings.step_timeout  # (step_watchdog.py)
    loop.watchdog.stalled_request_timeout = settings.stalled_request_timeout

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
    install_error_handlers(app)

    routes = OpenAIRoutes(loop, model_name, settings)
    app.add_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_route("/v1/completions", routes.completions, methods=["POST"])
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.api_route("/health", methods=["GET", "HEAD"])(routes.health)
    app.get("/metrics")(routes.metrics)
    return app


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
