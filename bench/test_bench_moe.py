"""fused_moe (router, grouping, grouped GEMMs, combine: csrc/moe_route.cu, csrc/moe_gemm.cu) vs
the PyTorch reference (a loop over the experts that received tokens, with a host sync), a
dense loop over every expert (no sync, every expert's weights read) and torch._grouped_mm (the
pairs sorted by expert on the device, one grouped GEMM per projection), at Qwen3-30B-A3B's expert
shapes (E = 128, k = 8, H = 2048, I = 768) and Mixtral 8x7B's (E = 8, k = 2, H = 4096,
I = 14336), bf16, side by side with the ceilings measured in this run.

Decode (T = 1..64): GB/s of the bytes the layer must read, the routed experts' weights
(3*H*I*2 bytes each distinct expert) plus activations; target >= 70% of copy bandwidth.
Prefill (T = 2048): TFLOP/s of 6*T*k*H*I; target >= 60% of the bf16 GEMM ceiling. In smoke
mode (no GPU) a tiny case runs once on the CPU, where fused_moe is the reference.
Quantized experts (int4 G = 32 / 128, int8): GB/s over the routed experts' code and scale
bytes (test_fused_moe_quantized), beside the bf16 rows; split-K against one split
(test_fused_moe_quantized_split_k, GPU only)."""

from __future__ import annotations

import pytest
import torch
from measure import gpu_paths, smoke_mode

from pagedkern import ops, reference

MODELS = {  # experts, top_k, hidden, intermediate
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
if smoke_mode():
    MODELS = {"tiny": (8, 2, 64, 32)}
DECODE = [1, 4] if smoke_mode() else [1, 4, 16, 64]
PREFILL = [16] if smoke_mode() else [2048]
IMPLS = ["pagedkern", "torch eager", "dense loop over experts", "torch._grouped_mm"]
_layers: dict = {}


def layer(model: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    if model not in _layers:
        _layers.clear()  # one model's experts at a time (Mixtral's are 2.8 GB)
        experts, _, hidden, inter = MODELS[model]
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(0)
        w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device)
        w_down = torch.randn(experts, hidden, inter, generator=gen, device=device)
        _layers[model] = ((w_gate_up * hidden**-0.5).to(dtype), (w_down * inter**-0.5).to(dtype))
    return _layers[model]


def dense_loop(x, logits, w_gate_up, w_down, top_k):
    """Every expert over every token, weighted by the routing (zero where not routed): no host
    sync, every expert's weights read: the capturable baseline without a grouped kernel."""
    weights, ids = reference.moe_route(logits, top_k, True)
    combine = torch.zeros(logits.shape, dtype=torch.float32, device=x.device)
    combine.scatter_(1, ids, weights)
    inter = w_down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        gu = (x @ w_gate_up[e].T).float()
        h = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype)
        out += (h @ w_down[e].T).float() * combine[:, e : e + 1]
    return out.to(x.dtype)


def grouped_mm(x, logits, w_gate_up, w_down, top_k):
    """torch._grouped_mm: the pairs sorted by expert on the device (no host sync), one grouped
    GEMM per projection with silu_and_mul between, the weighted combine by index_add_."""
    weights, ids = reference.moe_route(logits, top_k, True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=w_gate_up.shape[0]), 0).to(torch.int32)
    token = order // top_k
    gate_up = torch._grouped_mm(x[token], w_gate_up.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(reference.silu_and_mul(gate_up), w_down.transpose(1, 2), offs=ends)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens", DECODE + PREFILL)
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe(measure, device, gemm_tflops, model, tokens, impl):
    experts, top_k, hidden, inter = MODELS[model]
    w_gate_up, w_down = layer(model, device)
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(w_gate_up.dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    args = (x, logits, w_gate_up, w_down, top_k)
    fn = {
        "pagedkern": lambda: ops.fused_moe(*args),
        "torch eager": lambda: reference.fused_moe(*args),
        "dense loop over experts": lambda: dense_loop(*args),
        "torch._grouped_mm": lambda: grouped_mm(*args),
    }[impl]
    if impl == "torch._grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    routed = int(reference.moe_route(logits, top_k, True)[1].unique().numel())
    read = experts if impl == "dense loop over experts" else routed
    weight_bytes = read * 3 * hidden * inter * w_gate_up.element_size()
    nbytes = weight_bytes + 2 * x.numel() * x.element_size() + logits.numel() * 4
    flops = 6 * tokens * top_k * hidden * inter
    prefill = tokens in PREFILL
    notes = {}
    if impl == "pagedkern":
        notes = {"target": ">= 60% of GEMM" if prefill else ">= 70% of copy", "experts": routed}
    result = measure(
        "fused_moe",
        f"{model} T={tokens} {'prefill' if prefill else 'decode'}",
        impl,
        fn,
        bytes=None if prefill else nbytes,
        flops=flops,
        **notes,
    )
    assert result.seconds > 0


# Quantized experts (csrc/moe_gemm_quant.cu, W4A16 / W8A16): the same layers, the experts
# quantized at load; decode GB/s over the bytes actually read (the routed experts' codes and
# scales, plus activations), prefill TFLOP/s; the bf16 rows above are the comparison.
QUANT_FORMATS = {"int4 g32": ("int4", 32), "int4 g128": ("int4", 128), "int8": ("int8", 0)}
_quantized: dict = {}


def quantized_layer(model: str, device: str, fmt: str, group: int):
    from pagedkern.model.quantized_linear import quantize_experts

    key = (model, fmt, group)
    if key not in _quantized:
        _quantized.clear()
        w_gate_up, w_down = layer(model, device)
        _quantized[key] = tuple(quantize_experts(w, fmt, group or 32) for w in (w_gate_up, w_down))
    return _quantized[key]


@pytest.mark.parametrize("quant", list(QUANT_FORMATS))
@pytest.mark.parametrize("tokens", DECODE + PREFILL)
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe_quantized(measure, device, model, tokens, quant):
    experts, top_k, hidden, inter = MODELS[model]
    fmt, group = QUANT_FORMATS[quant]
    if fmt == "int4" and (hidden % group or inter % group):
        pytest.skip(f"H {hidden}, I {inter} not multiples of G {group}")
    w_gate_up, w_down = quantized_layer(model, device, fmt, group)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    routed = int(reference.moe_route(logits, top_k, True)[1].unique().numel())
    per_expert = (w_gate_up.nbytes + w_down.nbytes) // experts  # codes + scales (+ mins)
    nbytes = routed * per_expert + 2 * x.numel() * x.element_size() + logits.numel() * 4
    prefill = tokens in PREFILL
    result = measure(
        "fused_moe",
        f"{model} T={tokens} {'prefill' if prefill else 'decode'}",
        f"pagedkern {quant}",
        lambda: ops.fused_moe(x, logits, w_gate_up, w_down, top_k),
        bytes=None if prefill else nbytes,
        flops=6 * tokens * top_k * hidden * inter,
        target=">= 60% of GEMM" if prefill else ">= 70% of copy",
        experts=routed,
    )
    assert result.seconds > 0


# Split-K against one split over quantized experts at decode (GPU only; the float rows are
# test_fused_moe_gemm_variants'): GB/s over the routed experts' codes and scales plus
# activations, against copy bandwidth, with the splits moe_split_k chose for (gate_up, down).
@pytest.mark.parametrize("variant", ["split_k", "no_split_k"])
@pytest.mark.parametrize("quant", list(QUANT_FORMATS))
@pytest.mark.parametrize("tokens", DECODE)
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe_quantized_split_k(measure, device, model, tokens, quant, variant):
    from pagedkern.ops import moe
    from pagedkern.ops.variants import use_kernels

    if not gpu_paths():
        pytest.skip("split-K needs a GPU (on the CPU fused_moe is the reference)")
    experts, top_k, hidden, inter = MODELS[model]
    fmt, group = QUANT_FORMATS[quant]
    if fmt == "int4" and (hidden % group or inter % group):
        pytest.skip(f"H {hidden}, I {inter} not multiples of G {group}")
    w_gate_up, w_down = quantized_layer(model, device, fmt, group)
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    routed = int(reference.moe_route(logits, top_k, True)[1].unique().numel())
    per_expert = (w_gate_up.nbytes + w_down.nbytes) // experts  # codes + scales (+ mins)
    nbytes = routed * per_expert + 2 * x.numel() * x.element_size() + logits.numel() * 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    with use_kernels(moe_gemm=variant):
        splits = moe.moe_splits(tokens, top_k, experts, hidden, inter, 16, sms)
        result = measure(
            "fused_moe split-K",
            f"{model} T={tokens} decode {quant}",
            f"pagedkern {variant}",
            lambda: ops.fused_moe(x, logits, w_gate_up, w_down, top_k),
            bytes=nbytes,
            flops=6 * tokens * top_k * hidden * inter,
            target=">= 70% of copy",
            splits=f"{splits[0]}/{splits[1]}",
        )
    assert result.seconds > 0


# gpt-oss's mode (softmax over the top-k, expert biases in both epilogues, the clamped SwiGLU):
# gpt-oss-20b's experts, against the reference on the same weights
GPT_OSS = {"tiny": (8, 2, 64, 32)} if smoke_mode() else {"gpt-oss-20b": (32, 4, 2880, 2880)}


@pytest.mark.parametrize("impl", ["pagedkern", "torch eager"])
@pytest.mark.parametrize("tokens", DECODE + PREFILL)
@pytest.mark.parametrize("model", list(GPT_OSS))
def test_fused_moe_gpt_oss(measure, device, model, tokens, impl):
    experts, top_k, hidden, inter = GPT_OSS[model]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(tokens)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    w_gate_up, w_down = (
        randn(experts, 2 * inter, hidden, scale=hidden**-0.5),
        randn(experts, hidden, inter, scale=inter**-0.5),
    )
    x, logits = randn(tokens, hidden), torch.randn(tokens, experts, generator=gen, device=device)
    kwargs = dict(
        renormalize=False, scoring="softmax_topk", activation="clamped_swiglu",
        w_gate_up_bias=randn(experts, 2 * inter, scale=0.1),
        w_down_bias=randn(experts, hidden, scale=0.1),
    )  # fmt: skip
    args = (x, logits, w_gate_up, w_down, top_k)
    impls = {"pagedkern": ops.fused_moe, "torch eager": reference.fused_moe}
    routed = int(reference.moe_route(logits, top_k, False, "softmax_topk")[1].unique().numel())
    weight_bytes = routed * (3 * hidden * inter + 3 * inter + hidden) * x.element_size()
    prefill = tokens in PREFILL
    result = measure(
        "fused_moe gpt-oss",
        f"{model} T={tokens} {'prefill' if prefill else 'decode'}",
        impl,
        lambda: impls[impl](*args, **kwargs),
        bytes=None if prefill else weight_bytes + 2 * x.numel() * x.element_size(),
        flops=6 * tokens * top_k * hidden * inter,
        experts=routed,
    )
    assert result.seconds > 0


# The moe_gemm variants side by side on the same layers and tokens (GPU only): the mma.sync
# kernels (split_k, the default, and no_split_k) against the wgmma + TMA ones (sm90_wgmma, on
# sm_90 only; not yet verified on GPU). Decode GB/s over the routed experts' weights and the
# activations, prefill TFLOP/s, as test_fused_moe's pagedkern rows.
MOE_GEMM_VARIANTS = ["split_k", "no_split_k", "sm90_wgmma"]


@pytest.mark.parametrize("variant", MOE_GEMM_VARIANTS)
@pytest.mark.parametrize("tokens", DECODE + PREFILL)
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe_gemm_variants(measure, device, model, tokens, variant):
    from pagedkern.ops.variants import use_kernels

    if not gpu_paths():
        pytest.skip("the kernel variants need a GPU (on the CPU fused_moe is the reference)")
    if variant == "sm90_wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90_wgmma runs on sm_90 only")
    experts, top_k, hidden, inter = MODELS[model]
    w_gate_up, w_down = layer(model, device)
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(w_gate_up.dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    routed = int(reference.moe_route(logits, top_k, True)[1].unique().numel())
    nbytes = routed * 3 * hidden * inter * x.element_size() + 2 * x.numel() * x.element_size()
    prefill = tokens in PREFILL
    with use_kernels(moe_gemm=variant):
        result = measure(
            "fused_moe moe_gemm variants",
            f"{model} T={tokens} {'prefill' if prefill else 'decode'}",
            f"pagedkern {variant}",
            lambda: ops.fused_moe(x, logits, w_gate_up, w_down, top_k),
            bytes=None if prefill else nbytes + logits.numel() * 4,
            flops=6 * tokens * top_k * hidden * inter,
            experts=routed,
        )
    assert result.seconds > 0
