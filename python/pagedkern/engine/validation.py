"""Argument checks shared by SamplingParams, EngineConfig and Engine.add_request: every error
names the field, what it must be and what it got.

A wrong type raises ParameterTypeError, which is both a TypeError (what Python code expects)
and a ValueError (what the HTTP layer and the CLI turn into a 400 / exit 2), so no caller has
to know which of the two a check raises.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ParameterTypeError(TypeError, ValueError):
    """A field of the wrong type (bool is not an int, a str is not a list of ids, ...)."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """value, if it is an int (not a bool) with low <= value <= high."""
    if not is_int(value):
        raise ParameterTypeError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {shown(value)}")
    return value


def check_number(name: str, value: Any) -> float:
    """value as a float, if it is a finite int or float (not a bool, NaN or infinity)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ParameterTypeError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be finite, got {shown(value)}")
    return float(value)


def shown(value: Any) -> str:
    """value for an error message: a huge int by its size (str() refuses 4300+ digits)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ParameterTypeError(f"{name} must be true or false, got {value!r}")
    return value


def check_token_ids(name: str, ids: Any, vocab_size: int | None = None) -> list[int]:
    """ids as a list of ints, each in [0, vocab_size) (int64 without a vocab_size); the error
    names the first bad one. A float, a str or a bool is not a token id (numpy ints are)."""
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise ParameterTypeError(f"{name} must be a list of integer token ids, got {ids!r}")
    ids = list(ids)
    end = INT64_MAX + 1 if vocab_size is None else vocab_size
    if all(type(i) is int for i in ids) and (not ids or (min(ids) >= 0 and max(ids) < end)):
        return ids  # the fast path: plain ints in range
    out = []
    for k, value in enumerate(ids):
        try:
            index = None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            index = None
        if index is None:
            raise ParameterTypeError(f"{name}[{k}] must be an integer token id, got {value!r}")
        if not 0 <= index < end:
            raise ValueError(f"{name}[{k}] = {index} is not a token id (must be in [0, {end - 1}])")
        out.append(index)
    return out


def check_messages(messages: Any) -> list[dict]:
    """A chat conversation: a non-empty list of dicts (their contents are the template's)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ParameterTypeError(f"messages must be a list of messages (dicts), got {messages!r}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ParameterTypeError(f"messages[{i}] must be a dict, got {message!r}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a 'role' string, got {message!r}")
        if not isinstance(message.get("content", ""), (str, list, type(None))):
            raise ParameterTypeError(f"messages[{i}]['content'] must be a string or a list")
    return [dict(m) for m in messages]
