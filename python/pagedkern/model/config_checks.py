"""Type checks of a checkpoint's config values (config.json keys, GGUF metadata), done once
before the readers convert them: a value of the wrong type is refused naming its key, where
int() would truncate 2.5, bool("false") is True and a list where a number belongs would fail
deep inside a reader. Ranges are ModelConfig's to check (config.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ModelLoadError


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:  # (an integral float: some exporters write 2.0)
    return _number(v) and float(v).is_integer()


# kind -> (test, what the message says the value must be)
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "size": (lambda v: _int(v) and v >= 1, "a positive integer"),
    "count": (lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "int": (_int, "an integer"),
    "number": (_number, "a finite number"),
    "bool": (lambda v: isinstance(v, bool) or v in (0, 1), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "strs": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "a list of strings",
    ),
    "ints": (lambda v: isinstance(v, list) and all(_int(x) for x in v), "a list of integers"),
    "numbers": (
        lambda v: isinstance(v, list) and all(_number(x) for x in v),
        "a list of finite numbers",
    ),
}


def check_types(
    values: Mapping[str, Any],
    kinds: Mapping[str, str],
    source: str | os.PathLike,
    prefix: str = "",
    label: str = "",
) -> None:
    """Refuse (ModelLoadError naming label + prefix + key and the value) any values[prefix + key]
    that is present, not null, and not of its kind in `kinds` (a key of _KINDS)."""
    for key, kind in kinds.items():
        value = values.get(prefix + key)
        test, what = _KINDS[kind]
        if value is not None and not test(value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ModelLoadError(source, f"{label}{prefix}{key} must be {what}, got {shown}")


def token_ids(value: Any, key: str, source: str | os.PathLike) -> list[int]:
    """A stop / end-of-sequence id, or a list of them, as a list; ModelLoadError naming key for
    anything else (a string, a float, an object)."""
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(source, f"{key} must be a token id or a list of them, got {value!r}")
    return ids
