"""The wire between the HTTP front end and the engine core: the messages of messages.py as
msgpack frames over one duplex `multiprocessing` connection (a Unix socket pair). A frame is a
message's `to_wire()` list (its tag, then its fields) of ints, floats, strings, None, lists and
maps; `pack` refuses anything else (msgpack raises TypeError for a Python object: there is no
`default` hook and no pickle anywhere on this path)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

import msgpack

from .messages import BY_TAG, Message


def pack(frame: list) -> bytes:
    """A frame's bytes; TypeError for anything that is not plain msgpack data."""
    return msgpack.packb(frame, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def encode(message: Message) -> bytes:
    return pack(message.to_wire())


def decode(data: bytes) -> Message:
    """The message in a frame; ValueError for a frame that is not one."""
    frame = unpack(data)
    if not isinstance(frame, list) or not frame or frame[0] not in BY_TAG:
        raise ValueError(f"not a message: {frame!r:.80}")
    try:
        return BY_TAG[frame[0]].from_wire(frame)
    except (TypeError, ValueError) as exc:  # a wrong number or shape of fields
        raise ValueError(f"a malformed {frame[0]!r} message: {exc}") from exc


class Channel:
    """One end of the connection; `send` is safe from any thread (one frame at a time)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._sending = threading.Lock()

    def send(self, message: Message) -> None:
        """Send a message; TypeError / ValueError / OverflowError (msgpack's) for a field it
        cannot carry (nothing is sent), OSError or ValueError from the connection."""
        self.send_frame(encode(message))

    def send_frame(self, data: bytes) -> None:
        """Send an encoded message."""
        with self._sending:
            self.conn.send_bytes(data)

    def recv(self) -> Message:
        """The next message; EOFError when the other end has closed, ValueError for a frame
        that is not a message."""
        return decode(self.conn.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
