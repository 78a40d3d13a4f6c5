"""What the front end's EngineClient raises to the HTTP layer, and a core's refusal of a
request (Refused's code) as the exception the client raises for it."""

from __future__ import annotations

from ...engine import RequestRejected


class QueueFull(Exception):
    """Too many requests are waiting (-> HTTP 429)."""


class EngineUnavailable(Exception):
    """The engine core has stopped (shut down, or died) (-> 503)."""


def refusal(code: str, message: str) -> Exception:
    """A Refused message's code as its exception: queue_full -> QueueFull,
    context_length_exceeded -> RequestRejected, invalid -> ValueError, else RuntimeError."""
    if code == "queue_full":
        return QueueFull(message)
    if code == "context_length_exceeded":
        return RequestRejected(message)
    if code == "invalid":
        return ValueError(message)
    return RuntimeError(message)
