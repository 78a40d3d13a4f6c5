"""The moe_gemm:sm90_wgmma variant without a GPU: which fused_moe calls take it
(ops/moe_sm90.takes), and the sm_90a kernel's layout assumptions checked on the host on the
very CuTe types it uses (tests/moe_gemm_sm90_layouts.cu: TMA's swizzled boxes against the
wgmma descriptors' layouts and the cp.async gather's addresses, the gather covering the A tile
once, gate and up columns in the same thread). Its GPU tests: test_moe_sm90_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch
from support.host_layouts import run_layout_check

from pagedkern._extension import extension_module
from pagedkern.ops import moe_sm90
from pagedkern.ops.arrays import view


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


@pytest.mark.slow  # a 15-40 s nvcc build of a host program; CI runs it
def test_layouts_on_the_host(tmp_path):
    run_layout_check("moe_gemm_sm90_layouts.cu", tmp_path)
