"""One mechanism selects kernel variants: PAGEDKERN_KERNELS=op:variant,... parsed against
pagedkern/ops/variants.py (a bad op or variant names the variable, the op and its variants),
`use_kernels` and the tests' `kernels` fixture set it, and docs/guides/kernels.md shows the same
table as VARIANTS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkern.ops import variants
from pagedkern.ops.launch import kernel_variant
from pagedkern.ops.variants import ENV_NAME, VARIANTS, kernels_value, selected, use_kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv(ENV_NAME, raising=False)


def test_defaults_when_unset(unset):
    for op, o in VARIANTS.items():
        assert selected(op) == o.default
        assert kernel_variant(op) == o.variants[0].code
    # The codes the kernels' parameters take (csrc/*.h): each op's are distinct.
    for o in VARIANTS.values():
        assert len({v.code for v in o.variants}) == len(o.variants)
        assert len(set(o.names)) == len(o.names)


def test_one_variable_selects_several_ops(monkeypatch):
    monkeypatch.setenv(ENV_NAME, " flash_prefill:v1 , SAMPLE:v3,")
    assert selected("flash_prefill") == "v1" and kernel_variant("flash_prefill") == 1
    assert selected("sample") == "v3" and kernel_variant("sample") == 0
    assert selected("rms_norm") == "v3"  # left out: the default


@pytest.mark.parametrize(
    "value, message",
    [
        ("sample:v9", "PAGEDKERN_KERNELS: sample must be one of auto, v4, v3, v2, got 'v9'"),
        ("sample", "PAGEDKERN_KERNELS: sample must be one of auto, v4, v3, v2, got ''"),
        ("flash:v1", "PAGEDKERN_KERNELS: unknown op 'flash' in 'flash:v1'; ops with variants: "),
        ("rope_and_cache:v2,rms_norm=v1", "unknown op 'rms_norm=v1'"),
    ],
)
def test_a_bad_value_names_the_variable_the_op_and_the_choices(monkeypatch, value, message):
    monkeypatch.setenv(ENV_NAME, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        kernel_variant("rms_norm")  # any op: the whole value is checked at once


def test_parsed_once_per_value(monkeypatch):
    variants.parse.cache_clear()
    monkeypatch.setenv(ENV_NAME, "rms_norm:v1")
    for _ in range(3):
        kernel_variant("rms_norm")
        kernel_variant("sample")
    info = variants.parse.cache_info()
    assert info.misses == 1 and info.hits == 5


def test_use_kernels_nests_and_restores(unset):
    with use_kernels(sample="v2"):
        assert os.environ[ENV_NAME] == "sample:v2"
        with use_kernels(rms_norm="v1", sample="v4"):
            assert selected("sample") == "v4" and selected("rms_norm") == "v1"
        assert os.environ[ENV_NAME] == "sample:v2"
        with use_kernels(sample="auto"):  # back to the default: left out of the value
            assert os.environ[ENV_NAME] == ""
    assert ENV_NAME not in os.environ
    with pytest.raises(ValueError, match="paged_attention must be one of auto, simt, mma"):
        kernels_value(paged_attention="tensor")


def test_a_child_process_sees_the_selection(unset):
    code = "from pagedkern.ops.variants import selected; print(selected('paged_attention'))"
    with use_kernels(paged_attention="simt"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "simt", out.stderr


def test_the_fixture_selects_until_the_test_ends(kernels, monkeypatch):
    monkeypatch.setenv(ENV_NAME, "rope_and_cache:v1")
    kernels(sample="v3")
    assert selected("sample") == "v3" and selected("rope_and_cache") == "v1"


def test_the_guide_lists_exactly_the_registry():
    text = (ROOT / "docs" / "guides" / "kernels.md").read_text()
    section = text[text.index("## Kernel variants") :]
    row = r"^\| `(\w+)` \| `(\w+)` \|\s*(yes|)\s*\| ([\d-]*) \| (.+) \|$"
    rows = re.findall(row, section, re.M)
    want = [
        (op, v.name, "yes" if v.name == o.default else "", v.verified or "", v.doc)
        for op, o in VARIANTS.items()
        for v in o.variants
    ]
    assert rows == want


def test_no_old_variant_variable_is_left():
    tracked = subprocess.run(
        ["git", "ls-files", "python", "tests", "bench", "tools", "docs", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".sh", ".txt") and path.is_file():
            found = re.findall(r"PAGEDKERN_\w+_VARIANT\b", path.read_text())
            assert not found, f"{name}: {found}"
