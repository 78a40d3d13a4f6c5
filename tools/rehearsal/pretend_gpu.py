"""pytest plugin (`-p pretend_gpu`, this folder on PYTHONPATH) for collection-only rehearsals:
module-level decisions see what they would see on the GPU machine (torch and pagedkern report
one Hopper device, so benchmark suites leave smoke mode), while nothing can run. Collection code
that branches on "is there a GPU" is thereby checked on a CPU machine; a test body never is:
the plugin refuses anything but --collect-only."""

from __future__ import annotations

import pytest
import torch

import pagedkern._extension as extension

DEVICE_NAME = "pretend GPU (collection-only rehearsal)"


def _pretend() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda device=None: DEVICE_NAME
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    module = extension.extension_module()
    extension._probe = lambda: (module if module is not None else extension, None)


_pretend()  # at import (-p loads plugins before any conftest), so conftests see it too


def pytest_configure(config: pytest.Config) -> None:
    if not config.option.collectonly:
        raise pytest.UsageError("pretend_gpu is for --collect-only runs: nothing may execute")
