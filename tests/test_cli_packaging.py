"""Packaging: the HTTP stack (fastapi, uvicorn, pydantic) is the `serve` extra, so
`import pagedkern`, the ops and the CLI without --http work without it, and --http without it
says what to install; the test extra pins ruff."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
HTTP_STACK = ("fastapi", "uvicorn", "pydantic", "pydantic_core", "starlette")
WITHOUT_HTTP_STACK = f"""
import sys
for name in {HTTP_STACK!r}:
    sys.modules[name] = None  # any import of it raises ImportError
import torch, pagedkern
x, w = torch.randn(3, 64), torch.rand(64)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
assert torch.allclose(pagedkern.rms_norm(x, w, 1e-6), ref, atol=1e-5)
from pagedkern.serving.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_http_stack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_HTTP_STACK, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_kernels_and_cli_work_without_the_http_stack():
    proc = run_without_http_stack(
        "--model", "synthetic:tiny", "--backend", "reference", "--max-tokens", "2", "hi"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_http_without_the_stack_says_what_to_install():
    proc = run_without_http_stack("--http", "--model", "synthetic:tiny")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'pagedkern[serve]'" in lines[0], proc.stderr


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_http_stack_is_an_extra_and_ruff_is_pinned():
    meta = project()
    core = " ".join(meta["dependencies"])
    assert not any(name in core for name in ("fastapi", "uvicorn", "pydantic"))
    serve = " ".join(meta["optional-dependencies"]["serve"])
    assert all(name in serve for name in ("fastapi", "uvicorn", "pydantic"))
    test = meta["optional-dependencies"]["test"]
    assert "pagedkern[serve]" in test
    assert [r for r in test if re.fullmatch(r"ruff==[\d.]+", r)], test


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_the_installed_ruff_is_the_pinned_one():
    pin = next(r for r in project()["optional-dependencies"]["test"] if r.startswith("ruff=="))
    installed = subprocess.run(["ruff", "--version"], capture_output=True, text=True).stdout
    assert installed.split()[-1] == pin.removeprefix("ruff==")
