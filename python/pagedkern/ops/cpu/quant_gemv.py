"""The CPU backend's quantized GEMM: csrc/cpu/quant_gemv.cpp (pagedkern._cpu, host-compiled),
x [M, K] fp32 against an int4 or int8 QuantizedWeight repacked once into its 16-row tiles,
activations quantized to int8 per block of 32 on the fly (llama.cpp's technique). Not the
reference's function bit for bit (x is rounded to int8 per block): tested against it with a
tolerance. Every path (AVX-512 VNNI, AVX2, portable C++) returns the same bits, and a row's
result depends on its own x row only (never on M or the other rows).

Without the module (built by setup.py with the host's C++ compiler; missing when there was no
compiler) `available()` is False with the reason, and ops.quant_linear keeps torch's int-pack
kernels."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from ...reference.quantized_weight import QuantizedWeight

PATHS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}  # csrc/cpu/quant_gemv.cpp's Path
# Multiply-adds below which a call runs on the calling thread alone: waking the GEMM's own pool
# while torch's OpenMP threads spin between ops cost a 2-thread decode 20x on a 2-vCPU host.
PARALLEL_MIN_MACS = 1 << 26
_PACKED_KEY = "cpu-gemv"


@functools.cache
def _probe() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(f"{__package__.rsplit('.', 2)[0]}._cpu"), ""
    except ImportError as exc:
        return None, (
            f"the CPU kernels pagedkern._cpu are not built ({exc}): the CPU backend's quantized "
            "GEMMs run torch's int-pack kernels; rebuild with a C++ compiler (g++ or clang++: "
            "pip install -e . or python setup.py build_ext --inplace)"
        )


def available() -> bool:
    return _probe()[0] is not None


def unavailable_reason() -> str:
    return _probe()[1]


def _module() -> ModuleType:
    cpu_kernels, reason = _probe()
    if cpu_kernels is None:
        raise RuntimeError(reason)
    return cpu_kernels


def supported_paths() -> list[str]:
    """The ISA paths this CPU runs (portable always), best last."""
    cpu_kernels = _module()
    return [name for name, code in PATHS.items() if cpu_kernels.path_supported(path=code)]


def best_path() -> str:
    code = _module().best_path()
    return next(name for name, c in PATHS.items() if c == code)


def packed(weight: QuantizedWeight) -> torch.Tensor:
    """The weight's 16-row tiles (uint8), built once per weight and kept in weight.packed."""
    tiles = weight.packed.get(_PACKED_KEY)
    if tiles is None:
        cpu_kernels, (n, k) = _module(), weight.shape
        if weight.format == "int4":
            tiles = torch.empty(cpu_kernels.int4_packed_bytes(n=n, k=k), dtype=torch.uint8)
            qweight, scales = weight.qweight.contiguous(), weight.scales.half().contiguous()
            mins = weight.mins.half().contiguous()
            cpu_kernels.pack_int4(
                out=tiles.data_ptr(), qweight=qweight.data_ptr(), scales=scales.data_ptr(),
                mins=mins.data_ptr(), n=n, k=k, group=weight.group_size,
            )  # fmt: skip
        else:
            tiles = torch.empty(cpu_kernels.int8_packed_bytes(n=n, k=k), dtype=torch.uint8)
            qweight = weight.qweight.contiguous()
            cpu_kernels.pack_int8(out=tiles.data_ptr(), qweight=qweight.data_ptr(), n=n, k=k)
        weight.packed[_PACKED_KEY] = tiles
    return tiles


def _threads(macs: int) -> int:
    return torch.get_num_threads() if macs >= PARALLEL_MIN_MACS else 1


def quant_gemv(
    x: torch.Tensor,
    weight: QuantizedWeight,
    path: str | None = None,
    threads: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 CPU (rows of unit stride) -> [M, N] float32 (into `out` if given:
    contiguous [M, N] float32). path: one of PATHS (default: the best this CPU runs; a path it
    does not run raises RuntimeError); threads: default torch.get_num_threads() from
    PARALLEL_MIN_MACS multiply-adds, else 1 (the bits are the same for any count)."""
    cpu_kernels = _module()
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D float32 CPU tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if k != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}: K must equal the weight's {weight.shape[1]}")
    if weight.format not in ("int4", "int8"):
        raise ValueError(f"weight format {weight.format!r} (int4 or int8)")
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {tuple(PATHS)}, got {path!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif tuple(out.shape) != (m, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be contiguous ({m}, {n}) fp32")
    tiles = packed(weight)
    args = dict(
        y=out.data_ptr(), y_stride=n, x=x.data_ptr(), x_stride=x.stride(0),
        packed=tiles.data_ptr(), m=m, n=n, k=k,
        threads=threads or _threads(m * n * k), path=-1 if path is None else PATHS[path],
    )  # fmt: skip
    if weight.format == "int4":
        cpu_kernels.gemv_int4(**args)
    else:
        scales = weight.packed.get("cpu-gemv-scales")
        if scales is None:
            scales = weight.packed["cpu-gemv-scales"] = weight.scales.float().contiguous()
        cpu_kernels.gemv_int8(scales=scales.data_ptr(), **args)
    return out
