"""rope_and_cache: pagedkern vs the PyTorch reference (eager and compiled), q/k/v as views into a
fused QKV output, 32 query / 8 KV heads, D = 128, bf16, every token written to the cache.
Bytes: T * D * 2 * (2 Hq + 5 Hkv): q and k read and written, v read, k and v written to their
pages (the cos/sin rows stay in L2). Target: >= 80% of the measured copy bandwidth at the
prefill size; a decode step (64 tokens) is launch-bound. fp8 rows: E4M3 pages written as
k / k_scale, v / v_scale (one byte per cache element: T * D * (2 (2 Hq + 3 Hkv) + 2 Hkv))."""

from __future__ import annotations

import pytest
import torch
from measure import compile_reference, smoke_mode, with_compile

import pagedkern
from pagedkern import reference
from pagedkern.reference import cos_sin_cache

HQ, HKV, D, BLOCK = (4, 2, 64, 16) if smoke_mode() else (32, 8, 128, 16)
CASES = [8] if smoke_mode() else [64, 8192]
IMPLS = with_compile(["pagedkern", "torch eager", "torch.compile"]) + [
    "pagedkern fp8",
    "torch eager fp8",
]
FP8_SCALES = {"k_scale": 0.02, "v_scale": 0.02}
_compiled = {}


def make_data(tokens: int, device: str):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=g, device=device).to(dtype)
    q = qkv[:, : HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(tokens, HKV, D)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=device, dtype=torch.int32)
    blocks = -(-tokens // BLOCK)
    slots = torch.randperm(blocks * BLOCK, generator=g, device=device)[:tokens].int()
    k_cache = torch.zeros(blocks, HKV, BLOCK, D, device=device, dtype=dtype)
    cos_sin = cos_sin_cache(D, 8192, device=device)
    return (q, k, v, positions, cos_sin, k_cache, torch.zeros_like(k_cache), slots)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens", CASES)
def test_rope_and_cache(measure, device, tokens, impl):
    args = make_data(tokens, device)
    scales = {}
    nbytes = tokens * D * args[0].element_size() * (2 * HQ + 5 * HKV)
    if impl.endswith("fp8"):
        fp8 = args[5].to(torch.float8_e4m3fn)
        args = (*args[:5], fp8, fp8.clone(), args[7])
        scales = FP8_SCALES
        nbytes = tokens * D * (args[0].element_size() * (2 * HQ + 3 * HKV) + 2 * HKV)
    op = {
        "pagedkern": pagedkern.rope_and_cache,
        "pagedkern fp8": pagedkern.rope_and_cache,
        "torch eager": reference.rope_and_cache,
        "torch eager fp8": reference.rope_and_cache,
        "torch.compile": _compiled.setdefault("rope", compile_reference(reference.rope_and_cache)),
    }[impl]
    notes = {"target": ">= 80% of copy"} if impl == "pagedkern" and tokens > 64 else {}
    result = measure(
        "rope_and_cache", f"T={tokens}", impl, lambda: op(*args, **scales), bytes=nbytes, **notes
    )
    assert torch.isfinite(args[0]).all()
    assert result.seconds > 0
