"""The CPU backend's quantized GEMM: csrc/cpu/ (pagedkern._cpu, host-compiled), x [M, K] fp32
against an int4 or int8 QuantizedWeight repacked once into its 16-row tiles, activations
quantized on the fly per block of 32 (llama.cpp's technique), to 16 bits by default (two int8
planes, ~250x closer to the fp32 product than llama.cpp's 8 bits, closer than bf16) or 8 bits
(llama.cpp's Q8). Not the reference's function bit for bit: tested against it with a
tolerance. Every ISA path (AVX-512 VNNI, AVX-VNNI, AVX2, Arm NEON dotprod, portable C++) returns
the same bits, and a row's result depends on its own x row only (never on M, the other rows or
the threads).

Without the module (built by setup.py with the host's C++ compiler; missing when there was no
compiler) `available()` is False with the reason, and ops.quant_linear keeps torch's int-pack
kernels."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from ...reference.quantized_weight import QuantizedWeight
from .. import variants

# The ISA paths in csrc/cpu/quant_gemv.h's Path order: x86's worst to best but for the last,
# Arm's, and AMX (added after it, x86's best; a CPU runs portable and one family's); the
# cpu_gemv_isa variant forces one.
PATHS = ("portable", "avx2", "avx_vnni", "avx512_vnni", "neon_dotprod", "avx512_amx")
ACTIVATION_BITS = (8, 16)
# Multiply-adds below which a call runs on the calling thread alone. The threads are torch's own
# OpenMP team (csrc/cpu/gemv.cpp). Every decode GEMV is split: splitting only the large calls
# left the team's workers idle between them and made a 2-thread decode slower than one thread
# (bench/results/2026-12-05-xeon-cpu-vs-llamacpp.md). Below 2^16 the barrier outweighs the rows.
PARALLEL_MIN_MACS = 1 << 16
_PACKED_KEY = "cpu-gemv"  # weight.packed: the tiles
_FORMAT_KEY = "cpu-gemv-format"  # weight.packed: their format, one of TILE_FORMATS
# csrc/cpu/quant_gemv.h's Format: int4_sym is int4 whose every group has m == -8 d exactly
# (GGUF Q4_0), packed without the m (4.5 bits a weight, not 5) and giving the same bits;
# int4_zp int4 whose every m is -(z d) with an integer z (GPTQ / AWQ), z packed as a byte.
TILE_FORMATS = (
    "int8", "int4", "int4_sym", "int8_g32", "int8_g16", "int6_g16", "int5_g32", "int6_k",
    "int4_k", "int4_zp",
)  # fmt: skip


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


def cpu_module() -> ModuleType:
    cpu_kernels, reason = _probe()
    if cpu_kernels is None:
        raise RuntimeError(reason)
    return cpu_kernels


def supported_paths() -> list[str]:
    """The ISA paths this CPU (and this build) runs, portable first, best last."""
    cpu_kernels = cpu_module()
    return [name for name in PATHS if cpu_kernels.path_supported(path=cpu_kernels.PATHS[name])]


def best_path() -> str:
    """The path quant_gemv runs by default: the `cpu_gemv_isa` kernel variant where it names
    one (PAGEDKERN_KERNELS=cpu_gemv_isa:avx2, for example), else the best this CPU runs."""
    forced = variants.selected("cpu_gemv_isa")
    if forced != "auto":
        return forced
    code = cpu_module().best_path()
    return next(name for name, c in cpu_module().PATHS.items() if c == code)


def packed(weight: QuantizedWeight) -> torch.Tensor:
    """The weight's 16-row tiles (uint8), built once per weight and kept in weight.packed with
    their format (tile_format). int4 (_pack_int4): int4_sym where every group has m == -8 d in
    fp16 (GGUF Q4_0), int4_zp where every m is -z d with an integer z and fp16 d (GPTQ / AWQ's
    zero points), int4_k where the scales and mins factor as Q4_K's (a GGUF Q4_K's always do),
    int4 where they are fp16 values, else int5_g32 (fp32 scales and mins, exactly). int8:
    int8_g32 / int8_g16 with a scale per group (int6_g16 where those codes all fit 6 bits, as
    GGUF Q6_K's do, and int6_k where their scales also factor as Q6_K's int8 per 16 times one
    per 256, as a Q6_K file's always do), int5_g32 with a scale and a min per 32 (GGUF Q5_*:
    codes in 0..31), else per-channel int8. Every choice gives the bits of the fp32 chain on
    the weight's own values."""
    tiles = weight.packed.get(_PACKED_KEY)
    if tiles is None:
        check_parts(weight)
        cpu_kernels = cpu_module()
        if weight.format == "int4":
            fmt, tiles = _pack_int4(cpu_kernels, weight)
        elif weight.mins is not None:  # int8 with mins: codes 0..31 per 32 (GGUF Q5_*)
            if weight.group_size != 32:
                raise ValueError(
                    f"int8 weights with mins need group_size 32, got {weight.group_size}"
                )
            qweight = weight.qweight.contiguous()
            if bool(((qweight < 0) | (qweight > 31)).any()):
                raise ValueError("int8 weights with mins need codes in 0..31 (int5_g32 tiles)")
            fmt, tiles = "int5_g32", _pack_int5(cpu_kernels, weight, qweight.view(torch.uint8))
        else:
            fmt, tiles = _pack_int8(cpu_kernels, weight)
        weight.packed[_FORMAT_KEY] = fmt
        weight.packed[_PACKED_KEY] = tiles
    return tiles


def check_parts(weight: QuantizedWeight) -> None:
    """The weight's parts against its format, shape and group size, with an error naming the
    part (the pack reads them by address): int4 qweight uint8 [N, K / 2], scales and mins float
    [N, K / G] (G 32 or 128); int8 qweight int8 [N, K], scales float [N] or [N, K / G] (G 16
    or 32), mins none or as the scales; K a multiple of 32."""
    if len(weight.shape) != 2:
        raise ValueError(f"weight shape must be [N, K], got {tuple(weight.shape)}")
    (n, k), fmt, g = weight.shape, weight.format, weight.group_size

    def need(part: str, tensor, dtype, shape: tuple[int, ...]) -> None:
        ok_dtype = tensor is not None and (
            tensor.is_floating_point() if dtype == "float" else tensor.dtype == dtype
        )
        if not ok_dtype or tuple(tensor.shape) != shape or tensor.device.type != "cpu":
            got = "None" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(
                f"{fmt} weight [{n}, {k}], group {g}: {part} must be a CPU {dtype} {shape}, "
                f"got {got}"
            )

    if fmt not in ("int4", "int8") or k <= 0 or k % 32 or n <= 0:
        raise ValueError(f"weight {fmt!r} [{n}, {k}]: int4 or int8, K a positive multiple of 32")
    groups = {"int4": (32, 128), "int8": (0, 16, 32)}[fmt]
    if g not in groups or (g and k % g):
        raise ValueError(f"{fmt} weight [{n}, {k}]: group_size {g} must be one of {groups}")
    if fmt == "int4":
        need("qweight", weight.qweight, torch.uint8, (n, k // 2))
        need("scales", weight.scales, "float", (n, k // g))
        need("mins", weight.mins, "float", (n, k // g))
        return
    need("qweight", weight.qweight, torch.int8, (n, k))
    need("scales", weight.scales, "float", (n, k // g) if g else (n,))
    if weight.mins is not None:
        need("mins", weight.mins, "float", (n, k // g) if g else (n,))


def _pack_int4(cpu_kernels: ModuleType, weight: QuantizedWeight) -> tuple[str, torch.Tensor]:
    """An int4 weight as tiles: (format, tiles). Its scales and mins may be fp16 or fp32 (GGUF
    Q4_K's d sc, exact in fp32 only); the tiles keep their values exactly."""
    (n, k), group, qweight = weight.shape, weight.group_size, weight.qweight.contiguous()
    scales, mins = weight.scales.float(), weight.mins.float()
    half_scales, half_mins = scales.half(), mins.half()
    in_half = bool(
        torch.equal(half_scales.float(), scales) and torch.equal(half_mins.float(), mins)
    )
    if in_half:
        half_scales, half_mins = half_scales.contiguous(), half_mins.contiguous()
        if cpu_kernels.int4_symmetric(
            scales=half_scales.data_ptr(), mins=half_mins.data_ptr(), count=half_scales.numel()
        ):
            return "int4_sym", _pack_int4_half(
                cpu_kernels, weight, "int4_sym", half_scales, half_mins
            )
    zeros = _zero_points(scales, mins)
    if zeros is not None:
        tiles = _empty_tiles(cpu_kernels, "int4_zp", n, k)
        half = scales.half().contiguous()
        cpu_kernels.pack_int4_zp(
            out=tiles.data_ptr(), qweight=qweight.data_ptr(), scales=half.data_ptr(),
            zeros=zeros.data_ptr(), n=n, k=k, group=group,
        )  # fmt: skip
        return "int4_zp", tiles
    per_32 = group // 32  # (G = 128: each group's pair over its four blocks of 32)
    scales = scales.repeat_interleave(per_32, dim=-1).contiguous()
    mins = mins.repeat_interleave(per_32, dim=-1).contiguous()
    if k % 256 == 0:
        d, dm = torch.empty(n, k // 256), torch.empty(n, k // 256)
        cs = torch.empty(n, k // 32, dtype=torch.uint8)
        cm = torch.empty(n, k // 32, dtype=torch.uint8)
        if cpu_kernels.factor_int4_scales(
            scales=scales.data_ptr(), mins=mins.data_ptr(), n=n, k=k, d=d.data_ptr(),
            dm=dm.data_ptr(), cs=cs.data_ptr(), cm=cm.data_ptr(),
        ):  # fmt: skip
            tiles = _empty_tiles(cpu_kernels, "int4_k", n, k)
            cpu_kernels.pack_int4_k(
                out=tiles.data_ptr(), qweight=qweight.data_ptr(), cs=cs.data_ptr(),
                cm=cm.data_ptr(), d=d.data_ptr(), dm=dm.data_ptr(), n=n, k=k,
            )  # fmt: skip
            return "int4_k", tiles
    if in_half:
        return "int4", _pack_int4_half(cpu_kernels, weight, "int4", half_scales, half_mins)
    codes = weight.unpacked_int4().contiguous()
    exact = QuantizedWeight("int8", (n, k), codes.view(torch.int8), scales, mins, 32)
    return "int5_g32", _pack_int5(cpu_kernels, exact, codes)


def _zero_points(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor | None:
    """The uint8 z with every min == -(z * scale) bit for bit in fp32 and every scale an fp16
    (int4_zp's condition: GPTQ / AWQ's w = s (q - z)), else None."""
    if not torch.equal(scales.half().float(), scales):
        return None
    z = torch.where(scales == 0, 0.0, -mins / scales).round()  # (a zero d: z 0, m must be -0)
    if not bool(((z >= 0) & (z <= 255)).all()):
        return None
    if not torch.equal((-(z * scales)).view(torch.int32), mins.view(torch.int32)):
        return None
    return z.to(torch.uint8).contiguous()


def _pack_int4_half(
    cpu_kernels: ModuleType,
    weight: QuantizedWeight,
    fmt: str,
    scales: torch.Tensor,
    mins: torch.Tensor,
) -> torch.Tensor:
    """int4 or int4_sym tiles of an int4 weight with its fp16 scales and mins."""
    (n, k), qweight = weight.shape, weight.qweight.contiguous()
    tiles = _empty_tiles(cpu_kernels, fmt, n, k)
    cpu_kernels.pack_int4(
        out=tiles.data_ptr(), qweight=qweight.data_ptr(), scales=scales.data_ptr(),
        mins=mins.data_ptr(), n=n, k=k, group=weight.group_size, format=cpu_kernels.FORMATS[fmt],
    )  # fmt: skip
    return tiles


def _pack_int5(
    cpu_kernels: ModuleType, weight: QuantizedWeight, codes: torch.Tensor
) -> torch.Tensor:
    """int5_g32 tiles: codes [N, K] uint8 (0..31) with the weight's fp32 scales, mins per 32."""
    (n, k), codes = weight.shape, codes.contiguous()
    scales, mins = weight.scales.float().contiguous(), weight.mins.float().contiguous()
    tiles = _empty_tiles(cpu_kernels, "int5_g32", n, k)
    cpu_kernels.pack_int5(
        out=tiles.data_ptr(), qweight=codes.data_ptr(), scales=scales.data_ptr(),
        mins=mins.data_ptr(), n=n, k=k,
    )  # fmt: skip
    return tiles


def _empty_tiles(cpu_kernels: ModuleType, fmt: str, n: int, k: int) -> torch.Tensor:
    """Room for an [N, K] weight's tiles in format `fmt` (uint8)."""
    return torch.empty(
        cpu_kernels.packed_bytes(format=cpu_kernels.FORMATS[fmt], n=n, k=k), dtype=torch.uint8
    )


def _pack_int8(cpu_kernels: ModuleType, weight: QuantizedWeight) -> tuple[str, torch.Tensor]:
    """An int8 weight without mins as tiles: (format, tiles). ValueError for a code of -128,
    which the kernels' sign trick cannot negate (the loaders requantize such weights)."""
    (n, k), group, qweight = weight.shape, weight.group_size, weight.qweight.contiguous()
    if bool((qweight == -128).any()):
        raise ValueError("int8 weight holds -128: the CPU kernels take codes in -127..127")
    if not group:
        tiles = _empty_tiles(cpu_kernels, "int8", n, k)
        cpu_kernels.pack_int8(out=tiles.data_ptr(), qweight=qweight.data_ptr(), n=n, k=k)
        return "int8", tiles
    scales = weight.scales.float().contiguous()
    if group == 16 and bool(((qweight >= -32) & (qweight <= 31)).all()):  # Q6_K's codes
        if k % 256 == 0:
            d = torch.empty(n, k // 256)
            c = torch.empty(n, k // 16, dtype=torch.int8)
            if cpu_kernels.factor_int6_scales(
                scales=scales.data_ptr(), n=n, k=k, d=d.data_ptr(), c=c.data_ptr()
            ):
                tiles = _empty_tiles(cpu_kernels, "int6_k", n, k)
                cpu_kernels.pack_int6_k(
                    out=tiles.data_ptr(), qweight=qweight.data_ptr(), c=c.data_ptr(),
                    d=d.data_ptr(), n=n, k=k,
                )  # fmt: skip
                return "int6_k", tiles
        fmt, pack, extra = "int6_g16", cpu_kernels.pack_int6, {}
    else:  # GGUF Q8_0's and other grouped int8
        fmt, pack, extra = f"int8_g{group}", cpu_kernels.pack_int8_grouped, {"group": group}
    tiles = _empty_tiles(cpu_kernels, fmt, n, k)
    pack(out=tiles.data_ptr(), qweight=qweight.data_ptr(), scales=scales.data_ptr(), n=n, k=k,
         **extra)  # fmt: skip
    return fmt, tiles


def tile_format(weight: QuantizedWeight) -> str:
    """The format of the weight's tiles (one of TILE_FORMATS; packs them if not yet packed)."""
    packed(weight)
    return weight.packed[_FORMAT_KEY]


def tile_format_code(weight: QuantizedWeight) -> int:
    """tile_format as csrc/cpu/'s Format code (the `format` argument of gemv and layer_tail)."""
    return cpu_module().FORMATS[tile_format(weight)]


def scales_address(weight: QuantizedWeight) -> int:
    """The address of an int8 weight's per-channel fp32 scales (made once, kept in
    weight.packed); 0 for int4 and grouped int8, whose scales are in their tiles."""
    if weight.format != "int8" or weight.int8_per_group:
        return 0
    per_channel = weight.packed.get("cpu-gemv-scales")
    if per_channel is None:
        per_channel = weight.packed["cpu-gemv-scales"] = weight.scales.float().contiguous()
    return per_channel.data_ptr()


def threads_for(macs: int) -> int:
    """The threads a GEMM of `macs` multiply-adds runs on: torch's count from
    PARALLEL_MIN_MACS up, else the calling thread alone."""
    return torch.get_num_threads() if macs >= PARALLEL_MIN_MACS else 1


def fp32_out(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """A GEMM's [m, n] float32 output: `out` checked (contiguous [m, n] float32), else a new
    one."""
    if out is None:
        return torch.empty(m, n, dtype=torch.float32)
    if tuple(out.shape) != (m, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be contiguous ({m}, {n}) fp32")
    return out


def quant_gemv(
    x: torch.Tensor,
    weight: QuantizedWeight,
    path: str | None = None,
    threads: int | None = None,
    out: torch.Tensor | None = None,
    activation_bits: int = 16,
) -> torch.Tensor:
    """x [M, K] float32 CPU (rows of unit stride) -> [M, N] float32 (into `out` if given:
    contiguous [M, N] float32). path: one of PATHS (default: best_path(); a path this CPU does
    not run raises RuntimeError); threads: default torch.get_num_threads() from
    PARALLEL_MIN_MACS multiply-adds, else 1 (the bits are the same for any count);
    activation_bits: 16 (default) or 8 (llama.cpp's Q8 activations)."""
    cpu_kernels = cpu_module()
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D float32 CPU tensor, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if k != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}: K must equal the weight's {weight.shape[1]}")
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits!r}")
    x = weight.gathered(x)  # (act-order: the stored columns' inputs)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = fp32_out(out, m, n)
    cpu_kernels.gemv(
        format=tile_format_code(weight), y=out.data_ptr(), y_stride=n, x=x.data_ptr(),
        x_stride=x.stride(0), packed=packed(weight).data_ptr(), scales=scales_address(weight),
        m=m, n=n, k=k,
        threads=threads or threads_for(m * n * k),
        path=cpu_kernels.PATHS[path or best_path()], activation_bits=activation_bits,
    )  # fmt: skip
    return out
