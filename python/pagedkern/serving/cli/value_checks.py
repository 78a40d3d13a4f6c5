"""The value checks of `pagedkern-serve`'s flags, as argparse types: a bad value's message
becomes the parser's one-line error (`pagedkern-serve: error: argument --port: expected a port
in 0..65535, got 70000`)."""

from __future__ import annotations

import argparse
import math

INT32 = 2**31 - 1
INT64 = 2**63 - 1


class _Check:
    """An argparse type: `convert` the text, then check the value with `ok`; `expect` says
    what a good value is."""

    def __init__(self, name: str, convert, ok, expect: str):
        self.__name__ = name  # argparse names the type in its message
        self.convert, self.ok, self.expect = convert, ok, expect

    def __call__(self, text: str):
        try:
            value = self.convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.expect}, got {text!r}") from None
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"expected {self.expect}, got {text}")
        return value


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


positive_int = _Check("positive int", int, lambda v: v >= 1, "an integer >= 1")
int32 = _Check("int32", int, lambda v: -INT32 - 1 <= v <= INT32, "an integer within int32")
int64 = _Check("int64", int, lambda v: -INT64 - 1 <= v <= INT64, "an integer within int64")
port = _Check("port", int, lambda v: 0 <= v <= 65535, "a port in 0..65535")
positive_float = _Check("positive float", _finite, lambda v: v > 0, "a finite number > 0")
fraction = _Check("fraction", _finite, lambda v: 0 < v <= 1, "a number in (0, 1]")
number = _Check("number", _finite, lambda v: True, "a finite number")
top_logprobs = _Check("logprobs", int, lambda v: 0 <= v <= 20, "an integer in 0..20")
