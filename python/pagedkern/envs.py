"""Every PAGEDKERN_* environment variable pagedkern reads at run time: its name, default, meaning
and parsing rule, in one place. The package reads them only through `ENV[name].get()` (or the
helpers below), so a value means the same everywhere and a malformed one is a ValueError naming
the variable. The build's variables are declared in setup.py, the tests' in tests/conftest.py
and the benchmarks' in bench/conftest.py.

Standard library only: setup.py loads this file by path (the package is not importable before
it is built) for the parsing rules (EnvVar, parse_bool), so the build parses as the package does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, got {raw!r}")


def parse_text(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _shadow_mode(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value in ("on", "strict", "off"):
        return value
    return "on" if parse_bool(name, raw) else "off"


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower() or choices[0]
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        return value

    return parse


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str | None  # as it would be written in the environment; None: unset
    doc: str
    parse: Callable[[str, str], object]
    when: str  # "build", "run" or "test": who reads it

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self):
        """The parsed value (the parsed default when unset; None for an unset one without)."""
        raw = os.environ.get(self.name, self.default)
        return None if raw is None else self.parse(self.name, raw)


_VARS = (
    EnvVar(
        "PAGEDKERN_KERNELS",
        None,
        "Kernel variants, op:variant[,op:variant...] (e.g. flash_prefill:v1,sample:v3); an op "
        "left out runs its default. The ops, their variants and defaults: "
        "pagedkern/ops/variants.py.",
        parse_text,
        "run",
    ),
    EnvVar(
        "PAGEDKERN_FLASH_PREFILL_PATH",
        "auto",
        "flash_prefill kernel path: auto, sm80 (mma.sync everywhere) or sm90 (wgmma + TMA; an "
        "error where it cannot run).",
        _choice("auto", "sm80", "sm90"),
        "run",
    ),
    EnvVar(
        "PAGEDKERN_SHADOW",
        "off",
        "run: shadow mode for engines that do not set it (on: every op also runs its PyTorch "
        "reference and is compared, per op and layer; strict: stop at the first divergence; "
        "1 means on, 0 off)",
        _shadow_mode,
        "run",
    ),
    EnvVar(
        "PAGEDKERN_CHECK_INDICES",
        "0",
        "1: debug mode, the kernels trap on an out-of-range block id, slot, position or length "
        "(the tests turn it on); off it costs one branch on a kernel parameter.",
        parse_bool,
        "run",
    ),
    EnvVar(
        "PAGEDKERN_CACHE_DIR",
        None,
        "Folder of the converted-weights cache; default $XDG_CACHE_HOME/pagedkern, else "
        "~/.cache/pagedkern.",
        parse_text,
        "run",
    ),
)
ENV: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str):
    """The parsed value of a declared variable (its parsed default when unset)."""
    return ENV[name].get()


def check_indices() -> bool:
    """PAGEDKERN_CHECK_INDICES: the kernels' debug-mode index checks (read at every launch)."""
    return ENV["PAGEDKERN_CHECK_INDICES"].get()
