"""Kernel variants: every op whose kernel was rewritten keeps the kernel it replaces selectable
until a GPU run has verified the new one (the GPU tests run every test on every variant), and
all of them are chosen through one environment variable:

    PAGEDKERN_KERNELS=flash_prefill:v1,sample:v3

a comma-separated list of `op:variant`; an op left out runs its default. The value is parsed
once per distinct string (a launch costs one environment lookup and a dict read), and a
malformed one is a ValueError naming the variable, the op and the values it allows.

`VARIANTS` below is the one list: each op's variants, its default first, what each variant is,
and the date a GPU run passed every test of it. docs/guides/kernels.md shows the same table
(tests/test_kernel_variants.py keeps the two equal). `use_kernels(sample="v3")` selects
variants for a block (it sets the variable, so threads and child processes see it too); the
tests' `kernels` fixture does the same until the test ends.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

from .. import envs

ENV_NAME = "PAGEDKERN_KERNELS"


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    code: int  # the `variant` field of the op's kernel parameters (csrc/*.h); -1: chosen per call
    doc: str
    verified: str | None  # the date a GPU run passed every test of this variant, or None


@dataclass(frozen=True, slots=True)
class OpVariants:
    op: str
    variants: tuple[Variant, ...]  # the default first

    @property
    def default(self) -> str:
        return self.variants[0].name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    def code(self, name: str) -> int:
        return next(v.code for v in self.variants if v.name == name)


_RUN2 = "2026-12-04"  # bench/results/2026-12-04-h200-run2.md: every GPU test of every variant

VARIANTS: dict[str, OpVariants] = {
    o.op: o
    for o in (
        OpVariants(
            "flash_prefill",
            (
                Variant(
                    "v2",
                    0,
                    "page ids fetched a tile ahead; path 2's softmax overlaps the in-flight P·V",
                    _RUN2,
                ),
                Variant("v1", 1, "the first schedule", _RUN2),
                Variant(
                    "sm90_options",
                    2,
                    "v2; calls with a window, soft-cap or sinks run path 2's options kernel "
                    "on Hopper (v2 runs them on path 1)",
                    None,
                ),
            ),
        ),
        OpVariants(
            "rms_norm",  # and fused_add_rms_norm
            (
                Variant("v3", 0, "weights loaded with x, before the reduction barrier", _RUN2),
                Variant("v1", 1, "weights loaded after the reduction barrier", _RUN2),
            ),
        ),
        OpVariants(
            "rope_and_cache",
            (
                Variant("v2", 0, "4 heads per thread share one cos/sin load", _RUN2),
                Variant("v1", 1, "one head per thread", _RUN2),
            ),
        ),
        OpVariants(
            "sample",
            (
                Variant(
                    "auto",
                    -1,
                    "per call, what measured fastest: v2 for plain sampling, v4 with logits "
                    "processing or logprob outputs",
                    _RUN2,
                ),
                Variant("v4", 2, "v3 with a row split over several CTAs at small batches", _RUN2),
                Variant("v3", 0, "processing, sampling and top-N logprobs in one kernel", _RUN2),
                Variant(
                    "v2",
                    1,
                    "a processing stage, then the sampling kernel; top-N as torch ops",
                    _RUN2,
                ),
            ),
        ),
        OpVariants(
            "quant_gemm",
            (
                Variant("v1", 0, "CUDA-core dot products, one warp per output channel", _RUN2),
                Variant(
                    "marlin",
                    1,
                    "int4 on mma.sync over tile-ordered weights, lop3 dequantization, 4-6 cp.async "
                    "stages (int8 and N or K not multiples of 64: v1)",
                    None,
                ),
            ),
        ),
        OpVariants(
            "paged_attention",
            (
                Variant(
                    "auto",
                    -1,
                    "per call: mma for GQA groups >= 4 at D 64 / 128, else simt",
                    _RUN2,
                ),
                Variant("simt", 0, "fp32 SIMT math, any D (the first kernel)", _RUN2),
                Variant("mma", 1, "mma.sync tensor cores wherever D is 64 or 128", _RUN2),
            ),
        ),
        OpVariants(
            "attention_plan",  # how the engine's model calls the attention kernels
            (
                Variant(
                    "on",
                    0,
                    "plan once per step, run per layer (ops/attention_plan.py); decode graphs "
                    "capture the runs",
                    None,
                ),
                Variant("off", 1, "the one-shot ops, planning inside every layer's call", _RUN2),
            ),
        ),
        OpVariants(
            "moe_gemm",  # fused_moe's grouped GEMMs, float and quantized experts
            (
                Variant(
                    "split_k",
                    0,
                    "K split over blocks where the grid under-fills the SMs (decode), fp32 "
                    "partials summed in order before the epilogue",
                    None,
                ),
                Variant(
                    "no_split_k", 1, "one block per row tile and N tile (the first grid)", None
                ),
                Variant(
                    "sm90_wgmma",
                    2,
                    "float experts on wgmma + TMA (csrc/moe_gemm_sm90.cu), sm_90 only; quantized "
                    "experts, and H or I not multiples of 8, run split_k's",
                    None,
                ),
            ),
        ),
        OpVariants(
            "cpu_quant_linear",  # the cpu backend's quant_linear (no GPU involved)
            (
                Variant(
                    "int16_activations",
                    2,
                    "csrc/cpu/: activations int16 per block of 32 as two int8 planes (VNNI "
                    "dots), ~250x closer to fp32 than llama.cpp's int8, closer than bf16",
                    None,
                ),
                Variant(
                    "int_pack",
                    0,
                    "torch's int-pack kernels, bf16 activations and bf16 out",
                    None,
                ),
                Variant(
                    "int8_activations",
                    1,
                    "csrc/cpu/: activations int8 per block of 32 (llama.cpp's Q8 method), "
                    "~0.5-1% error a GEMM",
                    None,
                ),
            ),
        ),
        OpVariants(
            "cpu_gemv_isa",  # which instruction set csrc/cpu/'s GEMV runs (the same bits)
            (
                Variant("auto", -1, "the best this CPU runs", None),
                Variant(
                    "avx512_amx",
                    5,
                    "avx512_vnni, with AMX tiles (int4 formats and int8 on 32+ rows, the other "
                    "formats on 16+)",
                    None,
                ),
                Variant("avx512_vnni", 3, "AVX-512 VNNI vpdpbusd zmm", None),
                Variant("avx_vnni", 2, "AVX-VNNI vpdpbusd ymm", None),
                Variant("avx2", 1, "AVX2 vpmaddubsw + vpmaddwd", None),
                Variant("portable", 0, "plain C++", None),
                Variant("neon_dotprod", 4, "Arm NEON sdot (ARMv8.2 dotprod)", None),
            ),
        ),
        OpVariants(
            "cpu_attention",  # the cpu backend's attention (no GPU involved)
            (
                Variant(
                    "kernel",
                    1,
                    "csrc/cpu/attention.cpp: every query row in one C++ call over the paged "
                    "fp32/bf16 cache, batch invariant by construction",
                    None,
                ),
                Variant(
                    "tiles",
                    0,
                    "ops/cpu/attention.py: BLAS tiles of 256 keys padded whole, the decode rows "
                    "over a float32 copy kept between steps",
                    None,
                ),
            ),
        ),
        OpVariants(
            "cpu_decoder",  # the cpu backend's stack of layers (no GPU involved)
            (
                Variant(
                    "fused",
                    1,
                    "csrc/cpu/decoder.cpp: a step's quantized layers (Llama, Mistral, Qwen2/3, "
                    "Gemma 2/3, and Qwen2/3-MoE, Mixtral) in one C++ call (QKV GEMV, QK-norm + "
                    "RoPE + cache, attention kernel with windows / sinks / soft-cap, layer tail)",
                    None,
                ),
                Variant("layers", 0, "the layer loop in Python, one call per op", None),
            ),
        ),
        OpVariants(
            "cpu_sample",  # the cpu backend's sampling (no GPU involved)
            (
                Variant(
                    "kernel",
                    1,
                    "csrc/cpu/sampling.cpp: a row's id in a few passes over its logits, "
                    "thresholds for min-p / top-k / top-p instead of sorting the vocabulary",
                    None,
                ),
                Variant("reference", 0, "reference/sampling.py's torch ops", None),
            ),
        ),
        OpVariants(
            "cpu_linear",  # the cpu backend's GEMM of fp32 weights (no GPU involved)
            (
                Variant(
                    "fixed_order",
                    1,
                    "csrc/cpu/dense_gemm.cpp: each output 16 lanes of fma chains over K and a "
                    "fixed tree, so a row's bits never depend on its batch (batch invariance)",
                    None,
                ),
                Variant(
                    "blas",
                    0,
                    "torch's F.linear (oneDNN / MKL): bits depend on the rows in the product",
                    None,
                ),
            ),
        ),
        OpVariants(
            "cpu_moe",  # the cpu backend's quantized experts (no GPU involved)
            (
                Variant(
                    "fused",
                    1,
                    "csrc/cpu/moe_experts.cpp: a layer's routed int4/int8 experts in one C++ "
                    "call (grouping, each expert's GEMVs, activation, weighted sum); in the "
                    "layer tail with the router and top-k (moe_mlp.cpp)",
                    None,
                ),
                Variant("loop", 0, "a loop over the experts, torch ops and a GEMV call each", None),
            ),
        ),
        OpVariants(
            "cpu_layer_tail",  # the cpu backend's layer after attention (no GPU involved)
            (
                Variant(
                    "fused",
                    1,
                    "csrc/cpu/layer_tail.cpp: O GEMV, add+norm, gate/up GEMV, SiLU or GELU-tanh x "
                    "mul, down GEMV, add+norm (and sandwich norms) in one C++ call (quantized "
                    "int4/int8 layers; a MoE layer's router, experts and shared expert)",
                    None,
                ),
                Variant("ops", 0, "the ops one by one, as on every other backend", None),
            ),
        ),
    )
}


def _error(message: str) -> ValueError:
    return ValueError(f"{ENV_NAME}: {message} (format: op:variant[,op:variant...])")


@functools.lru_cache(maxsize=16)
def parse(raw: str) -> dict[str, str]:
    """{op: variant} for a PAGEDKERN_KERNELS value, every op present (defaults filled in)."""
    chosen = {op: o.default for op, o in VARIANTS.items()}
    for item in raw.split(","):
        item = item.strip().lower()
        if not item:
            continue
        op, sep, name = (part.strip() for part in item.partition(":"))
        if op not in VARIANTS:
            raise _error(f"unknown op {op!r} in {raw!r}; ops with variants: {', '.join(VARIANTS)}")
        if not sep or name not in VARIANTS[op].names:
            raise _error(
                f"{op} must be one of {', '.join(VARIANTS[op].names)}, got {name!r} in {raw!r}"
            )
        chosen[op] = name
    return chosen


def selected(op: str) -> str:
    """The variant of `op` that runs (PAGEDKERN_KERNELS, else the default)."""
    return parse(envs.get(ENV_NAME) or "")[op]


def kernel_variant(op: str) -> int:
    """The code of the variant of `op` that runs, as its kernel parameters take it."""
    return VARIANTS[op].code(selected(op))


def kernels_value(**chosen: str) -> str:
    """The PAGEDKERN_KERNELS value that selects `chosen` ({op: variant}) on top of what the
    variable selects now (ops at their default left out); a bad op or variant raises."""
    merged = dict(parse(envs.get(ENV_NAME) or ""))
    merged.update(chosen)
    merged = parse(",".join(f"{op}:{name}" for op, name in merged.items()))
    return ",".join(f"{op}:{name}" for op, name in merged.items() if VARIANTS[op].default != name)


@contextlib.contextmanager
def use_kernels(**chosen: str) -> Iterator[None]:
    """Inside the block the given ops run the given variants, e.g. `with use_kernels(sample="v3"):`;
    the other ops keep what PAGEDKERN_KERNELS says. It sets the variable (process-wide: threads
    and child processes see it) and restores it after. Tests: the `kernels` fixture."""
    previous = os.environ.get(ENV_NAME)
    os.environ[ENV_NAME] = kernels_value(**chosen)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_NAME, None)
        else:
            os.environ[ENV_NAME] = previous
