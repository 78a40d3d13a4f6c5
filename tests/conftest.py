"""Test-wide switches: `gpu` tests skip without a usable CUDA device and kernels; `static` tests
need the built extension (no GPU) and fail instead of skipping where the build is required
(CI=true or PAGEDKERN_REQUIRE_CUDA=1); the kernels' debug-mode index checks are on
(PAGEDKERN_CHECK_INDICES=1 unless the environment says otherwise)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PAGEDKERN_CHECK_INDICES", "1")

import pagedkern
from pagedkern._extension import cuda_build_required, extension_module


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
