"""Running the app: the listening socket, and uvicorn with the server's connection limits and
a shutdown that aborts what the engine is running first."""

from __future__ import annotations

import signal
import socket

import uvicorn
from fastapi import FastAPI

from ..core.engine_client import EngineClient
from .connection import protocol_class
from .settings import ServerSettings


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening socket (port 0: a free one). Clients may connect before the server runs:
    the kernel queues them."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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
