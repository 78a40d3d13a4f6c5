"""The moe_gemm:sm90_wgmma variant without a GPU: which fused_moe calls take it
(ops/moe_sm90.takes), and the sm_90a kernel's layout assumptions checked on the host on the
very CuTe types it uses (tests/moe_gemm_sm90_layouts.cu: TMA's swizzled boxes against the
wgmma descriptors' layouts and the cp.async gather's addresses, the gather covering the A tile
once, gate and up columns in the same thread). Its GPU tests: test_moe_sm90_gpu.py."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from build_env import cuda_build_required

from pagedkern._extension import extension_module
from pagedkern.ops import moe_sm90
from pagedkern.ops.arrays import view

ROOT = Path(__file__).resolve().parents[1]


def _views(hidden: int, inter: int, offset: int = 0, stride: int | None = None):
    experts = 3
    x = torch.zeros(5, (stride or hidden) + offset, dtype=torch.bfloat16)[:, offset:][:, :hidden]
    gate_up = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    down = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    hv = view(x, "hidden")
    return hv, view(gate_up, "w_gate_up"), view(down, "w_down"), hv.strides[0]


def test_only_the_selected_variant_takes_calls(kernels):
    args = _views(64, 40)
    assert not moe_sm90.takes(*args)  # the default: mma.sync
    kernels(moe_gemm="sm90_wgmma")
    assert moe_sm90.takes(*args)


@pytest.mark.parametrize(
    "hidden, inter, offset, stride",
    [(37, 40, 0, None), (64, 23, 0, None), (64, 40, 1, None), (64, 40, 0, 68)],
    ids=["H % 8", "I % 8", "unaligned rows", "row stride % 8"],
)
def test_shapes_tma_cannot_address_run_the_default(kernels, hidden, inter, offset, stride):
    kernels(moe_gemm="sm90_wgmma")
    assert not moe_sm90.takes(*_views(hidden, inter, offset, stride))


def test_the_entry_point_takes_moe_experts_arguments():
    # ops/moe.py calls one or the other with the same keywords
    module = extension_module()
    if module is None:
        pytest.skip("the CUDA extension is not built")

    def names(entry) -> list[str]:
        return re.findall(r"(\w+): ", entry.__doc__.splitlines()[0])

    assert names(module.moe_experts_sm90) == names(module.moe_experts)
    assert "stream" in names(module.moe_experts) and "down_splits" in names(module.moe_experts)


def _nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [str(Path(os.environ.get(v, "/nonexistent")) / "bin/nvcc")
                   for v in ("CUDA_HOME", "CUDA_PATH")]  # fmt: skip
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and Path(c).is_file()), None)


def _cutlass_include() -> Path | None:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    return include if (include / "cute" / "tensor.hpp").is_file() else None


@pytest.mark.slow  # a 15-40 s nvcc build of a host program; CI runs it
def test_layouts_on_the_host(tmp_path):
    nvcc, include = _nvcc(), _cutlass_include()
    if nvcc is None or include is None:
        if cuda_build_required():
            pytest.fail("nvcc and the CUTLASS headers are needed for the layout check")
        pytest.skip("needs nvcc and the CUTLASS headers (nvidia-cutlass)")
    exe = tmp_path / "moe_gemm_sm90_layouts"
    cmd = [nvcc, "-std=c++17", "-O1", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}"]
    cmd += ["-isystem", str(include), "-o", str(exe), str(ROOT / "tests/moe_gemm_sm90_layouts.cu")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
