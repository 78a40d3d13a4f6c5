"""The build's environment variables as the tests see them. setup.py declares them (BUILD_ENV)
and the rule "the CUDA build is required here" (PAGEDKERN_REQUIRE_CUDA, else CI=true); the tests
load setup.py by path (it runs setup() only as __main__), so both read one rule: where the
build is required, tests that need the built extension fail instead of skipping."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


@functools.cache
def _setup():
    spec = importlib.util.spec_from_file_location("pagedkern_setup", SETUP)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cuda_build_required() -> bool:
    return _setup().cuda_build_required()


def build_variable(name: str):
    """The parsed value of one of setup.py's build variables (its default when unset)."""
    return _setup().BUILD_ENV[name].get()
