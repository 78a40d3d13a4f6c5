"""The package imports and explains itself on any machine; the built extension, where present,
reports its build and stays out of libtorch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from build_env import cuda_build_required

import pagedkern
from pagedkern._extension import CudaUnavailableError, extension_module, require


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


def _built_module():
    module = extension_module()
    if module is None:
        pytest.skip("the CUDA extension is not built")
    return module


@pytest.mark.static
def test_python_tables_mirror_the_cpp_enums():
    from pagedkern.ops import arrays
    from pagedkern.ops import flash_prefill as _  # noqa: F401  (the module, for PATHS)

    module = _built_module()
    prefill = sys.modules["pagedkern.ops.flash_prefill"]
    assert dict(module.DTYPE_CODES) == arrays.DTYPE_CODES
    assert dict(module.FLASH_PREFILL_PATHS) == prefill.PATHS
    activation = sys.modules["pagedkern.ops.activation"]
    assert dict(module.GATED_ACTIVATIONS) == activation.ACTIVATIONS


def _kernel_entry_points(module) -> list[str]:
    return [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]


@pytest.mark.static
def test_every_cpp_argument_is_named_and_keyword_only():
    # Two swapped positional strides would compile, validate and corrupt memory: the ABI takes
    # keywords only, and every parameter has a name.
    module = _built_module()
    for name in _kernel_entry_points(module):
        entry = getattr(module, name)
        # a launch class (plan/run): its constructor and run(); their first parameter is self
        functions = [entry.__init__, entry.run] if isinstance(entry, type) else [entry]
        for function in functions:
            signature = function.__doc__.splitlines()[0]
            params = signature[signature.index("(") + 1 : signature.rindex(")")]
            if params.startswith("self"):
                params = params.partition(", ")[2]
            assert "arg0" not in params, signature
            assert params == "" or params.startswith("*, "), signature
    with pytest.raises(TypeError):
        module.rms_norm(0, 0, 0, 0, 1, 8, 8, 8, 0, 1e-6, 0, 0, 0)  # positional: refused


def test_every_python_call_into_the_extension_uses_keywords():
    # The call sites: `module.<kernel>(...)`, `_C.<kernel>(...)` and `require().<kernel>(...)`.
    import ast
    from pathlib import Path

    import pagedkern.ops

    root = Path(pagedkern.__file__).parent
    names = {"rms_norm", "silu_and_mul", "paged_attention", "rope_and_cache", "sample",
             "flash_prefill", "flash_prefill_workspace_ints", "flash_prefill_path",
             "multiprocessor_count", "pointer_device", "compute_capability",
             "quant_gemm", "quant_gemm_marlin", "rejection_sample", "PagedAttentionLaunch",
             "FlashPrefillLaunch", "moe_route", "moe_align", "moe_experts", "moe_experts_quant",
             "moe_experts_sm90", "moe_padded_rows"}  # fmt: skip
    module = extension_module()
    if module is not None:
        assert names | {"device_count", "build_info"} == set(_kernel_entry_points(module))
    calls = 0
    bench = Path(__file__).resolve().parents[1] / "bench"  # the benchmarks call it too
    for path in [*root.rglob("*.py"), *bench.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            into_c = (isinstance(receiver, ast.Name) and receiver.id in ("module", "_C")) or (
                isinstance(receiver, ast.Call) and getattr(receiver.func, "id", "") == "require"
            )
            if into_c and node.func.attr in names:
                calls += 1
                assert not node.args, f"{path.name}:{node.lineno}: positional call into _C"
    assert calls >= 10


class _FakeC:
    def __init__(self, capability, archs="80-real,90a-real,80-virtual"):
        self.capability, self.archs = capability, archs

    def device_count(self):
        return 1, ""

    def compute_capability(self, *, device):
        return self.capability

    def build_info(self):
        return {"cuda_architectures": self.archs}


@pytest.mark.parametrize(
    "capability, archs, available",
    [((7, 5), "80-real,90a-real,80-virtual", False), ((7, 0), "80-real", False),
     ((8, 0), "80-real,90a-real,80-virtual", True), ((8, 9), "80-real,90a-real,80-virtual", True),
     ((9, 0), "90a-real", True), ((8, 0), "90a-real", False), ((10, 0), "80-real", False),
     ((10, 0), "80-real,80-virtual", True)],
)  # fmt: skip
def test_cuda_available_is_false_on_gpus_the_build_cannot_run(
    monkeypatch, capability, archs, available
):
    # Before: a T4 (sm_75) said True and failed at the first launch with "no kernel image".
    from pagedkern import _extension

    monkeypatch.setattr(pagedkern, "_C", _FakeC(capability, archs), raising=False)
    monkeypatch.setitem(sys.modules, "pagedkern._C", pagedkern._C)
    _extension._probe.cache_clear()
    try:
        assert pagedkern.cuda_available() is available
        reason = pagedkern.cuda_unavailable_reason()
        if not available:
            assert f"sm_{capability[0]}{capability[1]}" in reason and archs in reason
    finally:
        _extension._probe.cache_clear()


def test_an_extension_built_from_older_sources_is_reported_not_called(monkeypatch):
    from pagedkern import _extension

    class Stale:  # the base commit's module: no compute_capability, positional arguments
        __file__ = "/somewhere/_C.so"

        def device_count(self):
            return 1, ""

    monkeypatch.setattr(pagedkern, "_C", Stale(), raising=False)
    monkeypatch.setitem(sys.modules, "pagedkern._C", pagedkern._C)
    _extension._probe.cache_clear()
    try:
        assert not pagedkern.cuda_available()
        assert "built from older sources" in pagedkern.cuda_unavailable_reason()
    finally:
        _extension._probe.cache_clear()
