"""What the server answers when something goes wrong: every refusal and failure as an
OpenAI-shaped error (errors.APIError) with its status, and the app's exception handlers.

400 bad fields / token ids / prompt too long (code context_length_exceeded), 404 unknown route,
429 queue full (queue_full, with Retry-After), 500 anything unexpected, 503 engine stopped.
5xx bodies carry the request id, never internal exception text (that goes to the server log).
"""

from __future__ import annotations

import json
import logging

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine import RequestRejected
from ..core.engine_client import EngineUnavailable, QueueFull
from .connection import BodyGone, request_id
from .errors import APIError

log = logging.getLogger("pagedkern.serving")


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed from a request cannot fail to
    encode (JSONResponse's UTF-8 encoding would raise on it)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return ASCIIJSONResponse(error.body(), status_code=error.status, headers=headers)


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


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a handler raises becomes its OpenAI-shaped answer: APIError as it says,
    Starlette's (unknown route, wrong method) as one, a client gone before its body as 499
    (nobody reads it), anything else a logged 500."""

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
