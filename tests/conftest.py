"""Test-wide switches: `gpu` tests skip without a usable CUDA device and kernels; `static` tests
need the built extension (no GPU) and fail instead of skipping where the build is required
(CI=true or PAGEDKERN_REQUIRE_CUDA=1, setup.py's rule: build_env.py); the kernels' debug-mode
index checks are on (PAGEDKERN_CHECK_INDICES=1 unless the environment says otherwise).

TEST_ENV declares the environment variables only the tests and their tools read (the package's
run-time ones are in pagedkern/envs.py, the build's in setup.py, the benchmarks' in
bench/conftest.py)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PAGEDKERN_CHECK_INDICES", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one torch thread a worker: the workers fill the cores
    import torch

    torch.set_num_threads(1)

from build_env import cuda_build_required

import pagedkern
from pagedkern._extension import extension_module

TEST_ENV = {
    "PAGEDKERN_NO_EMULATION": "1 skips the CPU emulator tests (tests/emulator, built with g++).",
    "PAGEDKERN_BLOCK_IMPORTS": "comma-separated top-level modules that raise ImportError under "
    "tools/rehearsal/sitecustomize.py (the GPU-check rehearsal's missing packages).",
    "PAGEDKERN_GPU_STAGES": "tools/gpu_check.sh: another stage plan instead of "
    "tools/gpu_stages.txt (its own tests).",
    "PAGEDKERN_GPU_PATHS_LOG": "tools/rehearsal/gpu_paths.py: a file the stubbed extension writes "
    "its calls to (JSON).",
}


def _gpu_skip_reason() -> str | None:
    if not pagedkern.cuda_available():
        return pagedkern.cuda_unavailable_reason()
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device (CPU build of torch?)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    missing_build = extension_module() is None
    for item in items:
        if "gpu" in item.keywords and reason:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))
        if "static" in item.keywords and missing_build and not cuda_build_required():
            item.add_marker(pytest.mark.skip(reason="the CUDA extension is not built"))


@pytest.fixture(scope="session")
def cuda_binary():
    """Machine code of the built extension, read with cuobjdump (see cuda_binary.py)."""
    from cuda_binary import CudaBinary

    module = extension_module()
    if module is None:
        pytest.fail("the CUDA extension pagedkern._C is not built, but the build is required")
    return CudaBinary(module.__file__)


@pytest.fixture
def kernels(monkeypatch):
    """`kernels(sample="v3")` selects kernel variants (PAGEDKERN_KERNELS, ops/variants.py) on top
    of those already selected, until the test ends."""
    from pagedkern.ops.variants import ENV_NAME, kernels_value

    def select(**chosen: str) -> None:
        monkeypatch.setenv(ENV_NAME, kernels_value(**chosen))

    return select


@pytest.fixture
def decoder_runs(monkeypatch) -> list[int]:
    """The rows of each call of the CPU backend's one-call decoder (ops/cpu/decoder.py)."""
    from pagedkern.ops.cpu import decoder

    seen: list[int] = []
    real = decoder._run
    monkeypatch.setattr(decoder, "_run", lambda *a: seen.append(a[-3].shape[0]) or real(*a))
    return seen
