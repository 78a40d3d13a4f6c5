"""One source for every PAGEDKERN_* environment variable: each name used anywhere in the tree is
declared in pagedkern/envs.py (name, default, doc, parser), the package and setup.py read the same
rule for "build required", and malformed values are errors naming the variable."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkern import envs

ROOT = Path(__file__).resolve().parents[1]
# CMake-internal variables (set and read inside CMakeLists.txt, never in the environment).
CMAKE_ONLY = {"PAGEDKERN_KERNEL_SOURCES", "PAGEDKERN_ARCH_LIST"}


def _tree_files():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / f for f in tracked if (ROOT / f).is_file()]


def test_every_pagedkern_variable_in_the_tree_is_declared():
    names = set()
    for path in _tree_files():
        if path.suffix in (".so", ".png", ".gguf") or path.name == "envs.py":
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        names |= set(re.findall(r"\bPAGEDKERN_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert len(names) > 5
    undeclared = names - set(envs.ENV) - CMAKE_ONLY
    assert not undeclared, f"declare these in python/pagedkern/envs.py: {sorted(undeclared)}"
    for var in envs.ENV.values():
        assert var.doc and var.when in ("build", "run", "test")


def test_the_package_reads_its_variables_only_through_envs():
    package = ROOT / "python" / "pagedkern"
    for path in package.rglob("*.py"):
        if path.name == "envs.py":
            continue
        text = path.read_text()
        direct = re.findall(r"environ(?:\.get)?\s*[\[(]\s*[\"']PAGEDKERN_", text)
        assert not direct, f"{path.relative_to(ROOT)} reads a PAGEDKERN_ variable directly"
    setup = (ROOT / "setup.py").read_text()
    assert not re.findall(r"environ(?:\.get)?\s*[\[(]\s*[\"']PAGEDKERN_", setup)


@pytest.mark.parametrize(
    "env, required",
    [({}, False), ({"CI": "true"}, True), ({"PAGEDKERN_REQUIRE_CUDA": "1"}, True),
     ({"PAGEDKERN_REQUIRE_CUDA": "true"}, True), ({"PAGEDKERN_REQUIRE_CUDA": "false"}, False),
     ({"PAGEDKERN_REQUIRE_CUDA": "0", "CI": "true"}, False)],
)  # fmt: skip
def test_setup_and_package_agree_on_build_required(monkeypatch, env, required):
    # Before: setup.py took "true" as required, the package only "1"; the package also counted
    # CI=true, setup.py did not.
    for name in ("CI", "PAGEDKERN_REQUIRE_CUDA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from pagedkern._extension import cuda_build_required

    spec = importlib.util.spec_from_file_location("_setup_envs", ROOT / "python/pagedkern/envs.py")
    by_path = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = by_path
    try:
        spec.loader.exec_module(by_path)
        assert by_path.cuda_build_required() is required
    finally:
        del sys.modules[spec.name]
    assert cuda_build_required() is required
    assert "envs.cuda_build_required()" in (ROOT / "setup.py").read_text()


def test_malformed_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CHECK_INDICES", "maybe")
    with pytest.raises(ValueError, match="PAGEDKERN_CHECK_INDICES must be one of"):
        envs.check_indices()
    monkeypatch.setenv("PAGEDKERN_FLASH_PREFILL_PATH", "sm70")
    with pytest.raises(ValueError, match="PAGEDKERN_FLASH_PREFILL_PATH must be one of auto"):
        envs.ENV["PAGEDKERN_FLASH_PREFILL_PATH"].get()
    monkeypatch.setenv("PAGEDKERN_FLASH_PREFILL_PATH", " SM80 ")
    assert envs.ENV["PAGEDKERN_FLASH_PREFILL_PATH"].get() == "sm80"


def test_tests_run_with_the_kernels_index_checks_on():
    assert envs.check_indices()  # tests/conftest.py
