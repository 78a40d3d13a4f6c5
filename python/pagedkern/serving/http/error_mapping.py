"""What the server answers when something goes wrong: every refusal and failure as an
OpenAI-shaped error (errors.APIError) with its status, and the app's exception handlers.

400 bad fields / token ids / prompt too long (code context_length_exceeded), 404 unknown route,
429 queue full (queue_full, with Retry-After), 500 anything unexpected or a request failed in
the engine (engine_error; a broken tensor-parallel group's rank named), 503 engine stopped.
5xx bodies carry the request id, never internal exception text (that goes to the server log).
"""

from __future__ import annotations

import json
import logging
import re

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine import RequestRejected
from ..core.client_errors import EngineUnavailable, QueueFull
from ..core.request_stream import StreamOutput
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


def engine_error(request_id: str, out: StreamOutput) -> APIError:
    """A request that failed inside the engine: the cause goes to the log, the client gets the
    request id to quote (never the internal exception text). A schema the grammar engine could
    not follow (a limit met while generating) is the client's 400 naming response_format; masks
    and bans that left no token (engine NoTokenAllowed) a 400 naming the first of them."""
    schema = (out.error or "").removeprefix("StructuredOutputError: ")
    if schema != out.error:  # (a short message: llguidance's verbose errors are off)
        log.warning("request %s: %s", request_id, schema)
        return APIError(400, schema, param="response_format")
    masked = (out.error or "").removeprefix("NoTokenAllowed: ")
    if masked != out.error:  # the request's own masks and bans left nothing to sample
        log.warning("request %s: %s", request_id, masked)
        return APIError(400, masked, param=masked.partition(",")[0].partition(":")[0])
    log.error("request %s failed in the engine: %s", request_id, out.error)
    cause = tensor_parallel_cause(out.error)
    cause = f": {cause}" if cause else ""
    message = f"generation failed (request id {request_id}){cause}; the server log has the details"
    return APIError(500, message, type="server_error", code="engine_error")


_WORKER_EXITED = re.compile(r"tensor-parallel worker rank (\d+) \(pid \d+\) exited with (\w+ \d+)")
_RANK = re.compile(r"\brank (\d+)")


def tensor_parallel_cause(error: str | None) -> str | None:
    """The rank a broken tensor-parallel group names (its failure is the whole server's, not
    the request's, so the client may know it): "tensor-parallel worker rank 2 exited with
    signal 9", or "tensor-parallel rank 0 failed"; None for any other error."""
    if not error or not error.startswith("TensorParallelError"):
        return None
    if exited := _WORKER_EXITED.search(error):
        return f"tensor-parallel worker rank {exited[1]} exited with {exited[2]}"
    rank = _RANK.search(error)
    return f"tensor-parallel rank {rank[1]} failed" if rank else "the tensor-parallel group failed"


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
