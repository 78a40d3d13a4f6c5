"""The package imports and explains itself on any machine; the built extension, where present,
reports its build and stays out of libtorch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import pagedkern
from pagedkern._extension import (
    CudaUnavailableError,
    cuda_build_required,
    extension_module,
    require,
)


def test_availability_and_reason_agree():
    # Checked against what the extension itself reports, not against each other only.
    available = pagedkern.cuda_available()
    reason = pagedkern.cuda_unavailable_reason()
    assert available == (reason is None)
    module = extension_module()
    if module is None:
        assert not available and "pagedkern._C" in reason
    else:
        count, error = module.device_count()
        assert available == (count > 0)
        if not available:
            assert (error or "the device count is 0") in reason
    if available:
        assert require() is module
    else:
        assert len(reason) > 20  # a sentence, not a code
        with pytest.raises(CudaUnavailableError, match=re.escape(reason)):
            require()


def test_extension_is_built_where_required():
    if not cuda_build_required():
        pytest.skip("CUDA build not required here")
    module = extension_module()
    assert module is not None, pagedkern.cuda_unavailable_reason()
    info = module.build_info()
    assert "90a" in info["cuda_architectures"] and "80" in info["cuda_architectures"]


def test_extension_does_not_link_libtorch_or_dynamic_cudart():
    module = extension_module()
    if module is None:
        pytest.skip("the CUDA extension is not built")
    deps = subprocess.run(["ldd", module.__file__], capture_output=True, text=True).stdout
    assert "libtorch" not in deps and "libc10" not in deps
    assert "libcudart" not in deps  # the CUDA runtime is linked statically


def test_import_without_torch_loaded():
    # CuPy-only users: importing pagedkern must not import torch.
    code = "import sys, pagedkern; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
