"""flash_prefill over an fp8 (E4M3) KV cache on the GPU (path 1; path 2 does not read fp8, so an
fp8 cache takes path 1 on Hopper too): the kernel over the fp8 cache equals, bit for bit, the
16-bit kernel over the same cache converted to q's dtype with k_scale folded into its softmax
scale (E4M3 -> f16/bf16 is exact, and the math after the conversion is the same code), v_scale
scales the output, and it meets FlashAttention's rule against fp32 attention over the
dequantized cache. The same comparison runs on the CPU reference in
tests/test_flash_prefill_fp8.py, so its calls are checked without a GPU. The batch is the one
of test_flash_prefill_gpu.py: NaN outside the sequences' keys and behind the tables' unused
entries, outputs poisoned."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from kernel_check import every_variant, poisoned
from test_flash_prefill_gpu import (
    CHUNKS,
    DEVICE,
    PREFIXES,
    assert_flash_rule,
    attention_in_dtype,
    hopper,
    make_batch,
)

import pagedkern
from pagedkern import reference

# The module (pagedkern.ops.flash_prefill, attribute access gives the function of that name).
fp_module = importlib.import_module("pagedkern.ops.flash_prefill")

pytestmark = pytest.mark.gpu
kernel_variant = every_variant("flash_prefill", skip=("sm90_options",))  # v2 without options

FP8 = torch.float8_e4m3fn


def fp8_batch(pairs, num_heads, head_dim, dtype, block_size, seed):
    """make_batch's batch with its caches stored as E4M3 (k / k_scale, v / v_scale, saturated;
    NaN stays NaN), the scales mapping each cache's largest |x| to 224."""
    q, k, v, cu, table, seq = make_batch(pairs, num_heads, head_dim, dtype, block_size, seed)
    scales = [float(c.float().nan_to_num(0.0).abs().max()) / 224.0 for c in (k, v)]
    k8, v8 = ((c.float() / s).clamp(-448, 448).to(FP8) for c, s in zip((k, v), scales))
    return (q, k8, v8, cu, table, seq), scales


def compare_with_the_16bit_kernel(batch, k_scale, v_scale, head_dim, dtype):
    """The fp8 call against the 16-bit call over the same cache converted to q's dtype, then
    against attention over the dequantized cache. A 16-bit cache takes no k_scale / v_scale
    (ValueError), so the 16-bit call gets what the op does with them for an fp8 cache: k_scale
    folded into the softmax scale (the same float: head_dim**-0.5 * k_scale), v_scale applied to
    the output. Without v_scale the fp8 call equals the 16-bit call bit for bit: on the GPU both
    run the same kernel code after the exact conversion, on the CPU (the op's reference, which
    folds k_scale the same way: tests/test_flash_prefill_fp8.py) the same torch ops."""
    q, k8, v8, cu, table, seq = batch
    device, scale = q.device, head_dim**-0.5
    out8 = poisoned(q.shape, dtype, device)
    _, lse8 = pagedkern.flash_prefill(
        *batch, out=out8, return_lse=True, k_scale=k_scale, v_scale=v_scale
    )  # fmt: skip
    out8k = poisoned(q.shape, dtype, device)  # k_scale only: v_scale None means 1
    _, lse8k = pagedkern.flash_prefill(*batch, out=out8k, return_lse=True, k_scale=k_scale)
    out16 = poisoned(q.shape, dtype, device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fp_module.PATH_ENV, "sm80")  # the same kernel path as the fp8 cache
        _, lse16 = pagedkern.flash_prefill(
            q, k8.to(dtype), v8.to(dtype), cu, table, seq, scale * k_scale, out=out16,
            return_lse=True,
        )  # fmt: skip
    assert not torch.isnan(out8).any() and not torch.isnan(out16).any()
    eps = torch.finfo(dtype).eps
    assert torch.equal(out8k, out16)
    assert torch.equal(lse8k, lse16)
    assert torch.equal(lse8, lse16)  # v_scale scales the output only
    # v_scale: the 16-bit output times v_scale, within a rounding to dtype of each side.
    torch.testing.assert_close(out8.float(), out16.float() * v_scale, rtol=1.01 * eps, atol=2**-24)
    # ... and that is attention over the dequantized cache.
    kd, vd = k8.float() * k_scale, v8.float() * v_scale
    out32, lse32 = reference.flash_prefill(
        q.float(), kd, vd, cu, table, seq, scale, return_lse=True
    )  # fmt: skip
    low = attention_in_dtype(q, kd, vd, cu, table, seq, scale)
    assert_flash_rule(out8, out32, low)
    torch.testing.assert_close(lse8, lse32, atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_fp8_cache_equals_the_16bit_kernel_on_the_converted_cache(ratio, head_dim, dtype):
    pairs = list(itertools.product(CHUNKS[:4], PREFIXES))
    batch, (ks, vs) = fp8_batch(pairs, 2 * ratio, head_dim, dtype, 16, seed=ratio + head_dim)
    compare_with_the_16bit_kernel(batch, ks, vs, head_dim, dtype)


@pytest.mark.parametrize("block_size", [1, 5, 8, 32, 128])
def test_fp8_block_sizes(block_size):
    pairs = [(1, 0), (7, 40), (200, 0), (130, 333), (64, 64)]
    dtype = torch.bfloat16
    batch, (ks, vs) = fp8_batch(pairs, 6, 128, dtype, block_size, seed=block_size)
    out = poisoned(batch[0].shape, dtype, DEVICE)
    pagedkern.flash_prefill(*batch, out=out, k_scale=ks, v_scale=vs)
    q, k8, v8, cu, table, seq = batch
    kd, vd = k8.float() * ks, v8.float() * vs
    out32 = reference.flash_prefill(q.float(), kd, vd, cu, table, seq, 128**-0.5)
    assert_flash_rule(out, out32, attention_in_dtype(q, kd, vd, cu, table, seq, 128**-0.5))


def test_fp8_cache_takes_path_1_everywhere(monkeypatch):
    device = torch.cuda.current_device()
    for path in ("auto", "sm80"):
        assert fp_module.kernel_path(device, 128, 16, path, fp8_cache=True) == "sm80"
    batch, _ = fp8_batch([(5, 3)], 2, 64, torch.float16, 16, seed=0)
    monkeypatch.setenv(fp_module.PATH_ENV, "sm90")
    with pytest.raises(ValueError, match="fp8" if hopper() else "sm_90"):
        pagedkern.flash_prefill(*batch)
