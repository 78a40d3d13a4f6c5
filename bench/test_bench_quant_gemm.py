"""quant_gemm (W4A16 / W8A16, decode-shaped M) vs bf16 torch.mm, as GB/s of the weight bytes
beside the measured copy bandwidth (the roofline: decode GEMMs are weight-read bound). Target
on a GPU: >= 80% of copy bandwidth at M = 1..16 for 4096x4096 and 4096x14336 (N x K). In smoke
mode (no GPU) a tiny case runs once on the CPU path (torch's int-pack kernels). The last impl
dequantizes the int4 weight on every call, then bf16 torch.mm: where it beats quant_gemm, packed
weights would be better served so (the engine dequantizes at load on CUDA instead:
model/loading.py gemm_weights). The "marlin" impls are the same int4 weights through the
quant_gemm:marlin variant (csrc/quant_gemm_marlin.cu, tensor cores; GPU only, not yet verified
on GPU), beside the default v1 kernel on the same weights."""

from __future__ import annotations

import pytest
import torch
from measure import gpu_paths, smoke_mode

from pagedkern import ops
from pagedkern.model.quantized_linear import quantize_int4, quantize_int8
from pagedkern.ops.variants import use_kernels

SHAPES = [(64, 128)] if smoke_mode() else [(4096, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 4] if smoke_mode() else [1, 4, 16, 64]
IMPLS = [
    "int4 g128",
    "int4 g32",
    "int4 g128 marlin",
    "int4 g32 marlin",
    "int8",
    "bf16 torch.mm",
    "int4 g32 dequantized + torch.mm",
]
_weights: dict = {}


def weights(n: int, k: int, device: str) -> dict:
    if (n, k) not in _weights:
        w = torch.randn(n, k, device=device) * 0.02
        _weights.clear()  # one shape's weights at a time
        _weights[n, k] = {
            "int4 g128": quantize_int4(w, 128),
            "int4 g32": quantize_int4(w, 32),
            "int8": quantize_int8(w),
            "bf16 torch.mm": w.bfloat16(),
        }
        _weights[n, k][IMPLS[-1]] = _weights[n, k]["int4 g32"]
        for group in ("g128", "g32"):  # the same weights, the other kernel
            _weights[n, k][f"int4 {group} marlin"] = _weights[n, k][f"int4 {group}"]
    return _weights[n, k]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_quant_gemm(measure, device, n, k, m, impl):
    marlin = impl.endswith("marlin")
    if marlin and not gpu_paths():
        pytest.skip("quant_gemm:marlin is a CUDA kernel (the CPU path ignores the variant)")
    w = weights(n, k, device)[impl]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    if impl == "bf16 torch.mm":
        fn, nbytes = (lambda: x @ w.T), w.numel() * 2
    elif impl == IMPLS[-1]:  # per call: what packed weights would cost through bf16 GEMMs
        fn, nbytes = (lambda: x @ w.dequantize_rows(dtype=torch.bfloat16).T), w.nbytes
    else:
        fn, nbytes = (lambda: ops.quant_linear(x, w)), w.nbytes
    with use_kernels(quant_gemm="marlin" if marlin else "v1"):
        result = measure("quant_gemm", f"M={m} N={n} K={k}", impl, fn, bytes=nbytes + x.numel() * 2)
    assert result.seconds > 0
