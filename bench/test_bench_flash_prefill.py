"""flash_prefill: both pagedkern paths vs torch SDPA (flash and cuDNN backends) on the same data,
SDPA reading it in contiguous form [B, H, L, D] (K/V heads repeated for GQA). Causal, D = 128,
16k tokens in total, bf16; FLOPs = 4 * Hq * D * sum over sequences of (visible keys summed over
its queries), the causal count, the same for every implementation.

Targets on an H200: path 1 (mma.sync) at least SDPA flash (FlashAttention-2); path 2 (wgmma +
TMA) >= 550 TFLOP/s and ahead of SDPA cuDNN. fp8 (E4M3) cache: path 1 (the only path reading
fp8) over the same keys stored as E4M3, against path 1 over the bf16 cache (target: within 10%:
the conversion pass costs ALU work, the pages half the bytes) and the PyTorch reference over the
fp8 cache (batches of sequences up to 4096 keys: its scores are materialised). The skewed
batch (one long sequence and many short ones) has no SDPA counterpart (it needs a varlen
interface). D = 256 rows (Gemma 3 shaped: 16 query and 8 KV heads): path 1, which serves that
head dim in 64-row work items (path 2 has D 64 and 128), plain and with Gemma 3's 1024-key
sliding window (its FLOPs count the keys the window leaves), against SDPA flash and cuDNN
(not yet measured on a GPU). In smoke mode (CPU, tiny shapes)
pagedkern runs its reference and SDPA its math backend; the numbers mean nothing.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from measure import gpu_paths, smoke_mode

import pagedkern
from pagedkern._extension import require

# The module (pagedkern.ops.flash_prefill, attribute access gives the function of that name).
fp_module = importlib.import_module("pagedkern.ops.flash_prefill")

HEAD_DIM = 64 if smoke_mode() else 128
NUM_HEADS, NUM_KV_HEADS = (4, 2) if smoke_mode() else (32, 8)
BLOCK_SIZE = 16
# name -> [(chunk, cached prefix)] per sequence
CASES = (
    {"1x256": [(256, 0)], "skewed 128+8x16": [(128, 0)] + [(16, 0)] * 8}
    if smoke_mode()
    else {
        "1x16384": [(16384, 0)],
        "4x4096": [(4096, 0)] * 4,
        "16x1024": [(1024, 0)] * 16,
        "skewed 8192+64x128": [(8192, 0)] + [(128, 0)] * 64,
        "4x4096 after 4096 cached": [(4096, 4096)] * 4,
    }
)
IMPLS = [
    "pagedkern path 1",
    "pagedkern path 2",
    "torch sdpa flash",
    "torch sdpa cudnn",
    "pagedkern path 1 fp8",
    "pagedkern reference fp8",
]
PATH_OF = {"pagedkern path 1": "sm80", "pagedkern path 2": "sm90", "pagedkern path 1 fp8": "sm80"}
BASELINES = {
    "pagedkern path 1": "torch sdpa flash",
    "pagedkern path 2": "torch sdpa cudnn",
    "pagedkern path 1 fp8": "pagedkern path 1",
    "pagedkern reference fp8": "pagedkern path 1 fp8",
}
TARGETS = {
    "pagedkern path 1": ">= sdpa flash",
    "pagedkern path 2": ">= 550 TFLOP/s and > sdpa cudnn",
    "pagedkern path 1 fp8": ">= 0.9 x path 1 (bf16 cache)",
}
REFERENCE_MAX_KEYS = 4096  # the reference materialises [chunk, Hq, keys] fp32 scores
# Head dim 256: (D, Hq, Hkv), cases, implementations (path 1 plain and windowed, SDPA).
SHAPE_256 = (256, 4, 2) if smoke_mode() else (256, 16, 8)
CASES_256 = (
    {"D=256 1x256": [(256, 0)]}
    if smoke_mode()
    else {"D=256 4x4096": [(4096, 0)] * 4, "D=256 16x1024": [(1024, 0)] * 16}
)
WINDOW_256 = 64 if smoke_mode() else 1024  # Gemma 3's local layers
IMPLS_256 = ["pagedkern path 1", "pagedkern path 1 window", "torch sdpa flash", "torch sdpa cudnn"]
_data: dict = {}


def causal_flops(pairs, shape=None, window=None) -> int:
    """4 Hq D x the visible keys summed over the queries (query i of a chunk sees p + i + 1
    keys, at most `window`)."""
    head_dim, num_heads, _ = shape or (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    keys = sum(min(p + i + 1, window or p + i + 1) for n, p in pairs for i in range(n))
    return 4 * num_heads * head_dim * keys


def make_data(name: str, device: str):
    """Paged inputs for pagedkern and the same keys/values contiguous for SDPA."""
    if name in _data:
        return _data[name]
    _data.clear()
    heads = SHAPE_256 if name in CASES_256 else (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    head_dim, num_heads, num_kv_heads = heads
    pairs = {**CASES, **CASES_256}[name]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    seq_lens = [n + p for n, p in pairs]
    pages = [-(-s // BLOCK_SIZE) for s in seq_lens]
    shape = (sum(pages), num_kv_heads, BLOCK_SIZE, head_dim)
    k_cache = torch.zeros(shape, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(sum(pages), generator=g, device=device).int()
    table = torch.zeros(len(pairs), max(pages), dtype=torch.int32, device=device)
    keys, values, start = [], [], 0
    for b, (n_pages, seq_len) in enumerate(zip(pages, seq_lens, strict=True)):
        blocks = perm[start : start + n_pages]
        start += n_pages
        table[b, :n_pages] = blocks
        kv = []
        for cache in (k_cache, v_cache):
            x = torch.randn(
                num_kv_heads, n_pages * BLOCK_SIZE, head_dim, generator=g, device=device
            )
            x = x.to(dtype)
            cache[blocks.long()] = x.view(num_kv_heads, n_pages, BLOCK_SIZE, -1).transpose(0, 1)
            kv.append(x[:, :seq_len])
        keys.append(kv[0])
        values.append(kv[1])
    total = sum(n for n, _ in pairs)
    q = torch.randn(total, num_heads, head_dim, generator=g, device=device).to(dtype)
    chunks = torch.tensor([0] + [n for n, _ in pairs], device=device)
    cu = torch.cumsum(chunks, 0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    paged = (q, k_cache, v_cache, cu, table, seq)
    contiguous = None
    if len({(n, p) for n, p in pairs}) == 1 and pairs[0][1] == 0:
        # SDPA: [B, Hq, L, D], fresh prompts of one length (its causal mask is the prefill's).
        n, group = pairs[0][0], num_heads // num_kv_heads
        qs = q.view(len(pairs), n, num_heads, head_dim).transpose(1, 2).contiguous()
        ks = torch.stack(keys).repeat_interleave(group, 1).contiguous()
        vs = torch.stack(values).repeat_interleave(group, 1).contiguous()
        contiguous = (qs, ks, vs)
    _data[name] = (paged, contiguous, causal_flops(pairs, heads))
    return _data[name]


def fp8_paged(paged):
    """The batch with its caches stored as E4M3 (randn keys lie well inside +-448: scales 1);
    in smoke mode (fp32 data on the CPU) q in bf16, as an fp8 cache requires."""
    q, k_cache, v_cache, *rest = paged
    q = q if q.dtype in (torch.bfloat16, torch.float16) else q.bfloat16()
    return (q, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), *rest)


def sdpa_fn(impl, contiguous, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qs, ks, vs = contiguous
    if smoke_mode():
        backend = SDPBackend.MATH  # the flash / cuDNN kernels need a GPU
    else:
        backend = (
            SDPBackend.FLASH_ATTENTION if impl.endswith("flash") else SDPBackend.CUDNN_ATTENTION
        )

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    try:
        run()
    except RuntimeError as exc:  # backend unavailable for this GPU / build / shape
        pytest.skip(f"{impl} cannot run here: {str(exc).splitlines()[0]}")
    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_flash_prefill(measure, gemm_tflops, device, monkeypatch, case, impl):
    paged, contiguous, flops = make_data(case, device)
    extra = {}
    if impl.endswith("fp8"):
        paged = fp8_paged(paged)
    if impl == "pagedkern reference fp8":
        if max(n + p for n, p in CASES[case]) > REFERENCE_MAX_KEYS:
            pytest.skip(f"the reference materialises its scores: sequences <= {REFERENCE_MAX_KEYS}")
        from pagedkern import reference

        def fn():
            return reference.flash_prefill(*paged)

    elif impl in PATH_OF:
        path = PATH_OF[impl]
        if gpu_paths():
            if path == "sm90" and torch.cuda.get_device_capability() != (9, 0):
                pytest.skip("path 2 needs an sm_90 GPU")
            monkeypatch.setenv(fp_module.PATH_ENV, path)
        out = torch.empty_like(paged[0])
        ws = None
        if gpu_paths() and paged[1].dtype == torch.float8_e4m3fn:
            index = torch.cuda.current_device()
            taken = fp_module.kernel_path(index, HEAD_DIM, BLOCK_SIZE, fp8_cache=True)
            assert taken == path, f"an fp8 cache takes path 1 ({taken})"
        if gpu_paths():
            need = require().flash_prefill_workspace_ints(
                total_q=paged[0].shape[0], batch=len(paged[5])
            )
            ws = torch.empty(need, dtype=torch.int32, device=device)

        def fn():
            return pagedkern.flash_prefill(*paged, out=out, workspace=ws)

        extra["target"] = TARGETS[impl]
    else:
        if contiguous is None:
            pytest.skip("SDPA has no varlen / cached-prefix form of this batch")
        fn = sdpa_fn(impl, contiguous, device)
        if smoke_mode():
            extra["backend"] = "math (smoke)"
    result = measure(
        "flash_prefill", case, impl, fn, flops=flops, baseline=BASELINES.get(impl), **extra
    )
    assert result.seconds > 0 and gemm_tflops > 0


@pytest.mark.parametrize("impl", IMPLS_256)
@pytest.mark.parametrize("case", list(CASES_256))
def test_flash_prefill_head_dim_256(measure, gemm_tflops, device, monkeypatch, case, impl):
    paged, contiguous, flops = make_data(case, device)
    extra = {}
    if impl.startswith("pagedkern"):
        options = {}
        if impl.endswith("window"):
            options = dict(sliding_window=WINDOW_256)
            flops = causal_flops(CASES_256[case], SHAPE_256, WINDOW_256)
        if gpu_paths():
            monkeypatch.setenv(fp_module.PATH_ENV, "sm80")
            index = torch.cuda.current_device()
            assert fp_module.kernel_path(index, 256, BLOCK_SIZE, "auto") == "sm80"
        out = torch.empty_like(paged[0])

        def fn():
            return pagedkern.flash_prefill(*paged, out=out, **options)

        extra["target"] = ">= sdpa flash"
    else:
        fn = sdpa_fn(impl, contiguous, device)
        if smoke_mode():
            extra["backend"] = "math (smoke)"
    baseline = "torch sdpa flash" if impl.startswith("pagedkern") else None
    result = measure("flash_prefill", case, impl, fn, flops=flops, baseline=baseline, **extra)
    assert result.seconds > 0 and gemm_tflops > 0
