"""The requests a front end has open with its engine core, by id (EngineClient's)."""

from __future__ import annotations

import asyncio

from .request_stream import RequestStream

Admitting = tuple[asyncio.Future, RequestStream]  # what its submitter awaits, and its stream


class OpenRequests:
    """Each engine request is admitting (sent; the core's Added or Refused not back yet) or
    streaming (admitted; its samples not all finished). A request of several prompts sends one
    engine request per prompt under a group id, in use, as the parts' own ids are, until every
    part has left."""

    def __init__(self) -> None:
        self.admitting: dict[str, Admitting] = {}
        self.streams: dict[str, RequestStream] = {}
        self._group_of: dict[str, str] = {}  # an engine request's group
        self._parts: dict[str, int] = {}  # a group's parts still open

    def __len__(self) -> int:
        return len(self.admitting) + len(self.streams)

    def in_use(self, request_id: str) -> bool:
        return (
            request_id in self.admitting or request_id in self.streams or request_id in self._parts
        )

    def add(self, request_id: str, entry: Admitting, group: str | None = None) -> None:
        self.admitting[request_id] = entry
        if group is not None:
            self._group_of[request_id] = group
            self._parts[group] = self._parts.get(group, 0) + 1

    def admitted(self, request_id: str) -> Admitting | None:
        """Admitting -> streaming; None if it was not admitting (failed or cancelled since)."""
        entry = self.admitting.pop(request_id, None)
        if entry is not None:
            self.streams[request_id] = entry[1]
        return entry

    def drop(self, request_id: str) -> Admitting | None:
        """It leaves while admitting (refused, or its submitter cancelled); None if it was not."""
        entry = self.admitting.pop(request_id, None)
        if entry is not None:
            self._left(request_id)
        return entry

    def finished(self, request_id: str) -> None:
        """Its stream has every sample's end."""
        del self.streams[request_id]
        self._left(request_id)

    def take_all(self) -> tuple[dict[str, Admitting], list[RequestStream]]:
        """Every open request (to be failed), none left open."""
        admitting, streams = self.admitting, list(self.streams.values())
        self.admitting, self.streams = {}, {}
        self._group_of.clear()
        self._parts.clear()
        return admitting, streams

    def _left(self, request_id: str) -> None:
        group = self._group_of.pop(request_id, None)
        if group is not None:
            self._parts[group] -= 1
            if not self._parts[group]:
                del self._parts[group]
