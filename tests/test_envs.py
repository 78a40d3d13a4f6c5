"""Every PAGEDKERN_* environment variable used anywhere in the tree is declared once, by who
reads it: the package's run-time ones in pagedkern/envs.py (name, default, doc, parser), the
build's in setup.py, the tests' in tests/conftest.py and the benchmarks' in bench/conftest.py;
the package reads none but its own. The tests and setup.py read one rule for "build required",
and malformed values are errors naming the variable."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from build_env import _setup, cuda_build_required

from pagedkern import envs

ROOT = Path(__file__).resolve().parents[1]
# CMake-internal variables (set and read inside CMakeLists.txt, never in the environment).
CMAKE_ONLY = {"PAGEDKERN_KERNEL_SOURCES", "PAGEDKERN_BINDING_SOURCES", "PAGEDKERN_ARCH_LIST"}


def _tree_files():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / f for f in tracked if (ROOT / f).is_file()]


def _dict_keys(path: Path, name: str) -> set[str]:
    """The keys of the module-level dict literal `name` in `path` (a conftest: not importable by
    name, tests/ and bench/ both have one)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return {k.value for k in node.value.keys}
    raise AssertionError(f"{path} declares no {name}")


def _declared() -> dict[str, set[str]]:
    return {
        "run": set(envs.ENV),
        "build": set(_setup().BUILD_ENV),
        "test": _dict_keys(ROOT / "tests" / "conftest.py", "TEST_ENV"),
        "bench": _dict_keys(ROOT / "bench" / "conftest.py", "BENCH_ENV"),
    }


def test_every_pagedkern_variable_in_the_tree_is_declared_once():
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
    declared = _declared()
    everywhere = set().union(*declared.values())
    assert sum(map(len, declared.values())) == len(everywhere), f"declared twice: {declared}"
    undeclared = names - everywhere - CMAKE_ONLY
    assert not undeclared, (
        f"declare these in python/pagedkern/envs.py (run time), setup.py (build), "
        f"tests/conftest.py or bench/conftest.py: {sorted(undeclared)}"
    )
    for var in envs.ENV.values():
        assert var.doc and var.when == "run"


def test_the_package_reads_only_its_run_time_variables():
    # Build, test and benchmark variables stay out of the package; every run-time one is read.
    package = "\n".join(
        p.read_text() for p in (ROOT / "python" / "pagedkern").rglob("*.py") if p.name != "envs.py"
    )
    used = set(re.findall(r"\bPAGEDKERN_[A-Z0-9_]*[A-Z0-9]\b", package))
    others = set().union(*(v for k, v in _declared().items() if k != "run"))
    others.discard("PAGEDKERN_REQUIRE_CUDA")  # named, not read: _extension's reinstall hint
    assert not used & others, f"the package names non-run-time variables: {used & others}"
    assert set(envs.ENV) <= used, f"declared but never read: {set(envs.ENV) - used}"


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
def test_build_required_is_setup_py_rule(monkeypatch, env, required):
    # Before: setup.py took "true" as required, the package only "1"; the package also counted
    # CI=true, setup.py did not. Now the tests call setup.py's own rule (tests/build_env.py).
    for name in ("CI", "PAGEDKERN_REQUIRE_CUDA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cuda_build_required() is required
    setup = (ROOT / "setup.py").read_text()
    assert "if cuda_build_required():" in setup and 'if __name__ == "__main__":' in setup


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
