"""flash_prefill over an fp8 (E4M3) KV cache, on the CPU: the reference (and the op, which runs
it for CPU tensors) equals attention over the dequantized cache in float64, on fresh random
inputs over odd shapes, with the output poisoned; k_scale / v_scale mean "the stored K times
k_scale, the stored V times v_scale"; the op's fp8 argument checks name the argument, its shape
and dtype. The CUDA kernel's fp8 path is checked without a GPU by tests/flash_prefill_layouts.cu
(copy mapping + conversion, run on the host), test_flash_prefill_schedule.py (the row gather) and
the static SASS checks; on a GPU by tests/test_flash_prefill_fp8_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_check import assert_close_to, poisoned

import pagedkern
from pagedkern import reference

FP8 = torch.float8_e4m3fn


def fp8_batch(pairs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """q, fp8 caches storing k / k_scale and v / v_scale (saturated like rope_and_cache), the
    scales, cu_seqlens, shuffled block tables and seq_lens; slots outside the sequences NaN."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + p for c, p in pairs]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 2
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).int()
    table = torch.full((len(pairs), max(pages) + 1), int(perm[-1]), dtype=torch.int32)
    start = 0
    for b, (n_pages, seq_len) in enumerate(zip(pages, seq_lens, strict=True)):
        blocks = perm[start : start + n_pages]
        start += n_pages
        table[b, :n_pages] = blocks
        for cache, spread in ((k, 3.0), (v, 0.5)):
            keys = torch.full((num_kv_heads, n_pages * block_size, head_dim), float("nan"))
            keys[:, :seq_len] = torch.randn(num_kv_heads, seq_len, head_dim, generator=g) * spread
            cache[blocks.long()] = keys.view(num_kv_heads, n_pages, block_size, -1).transpose(0, 1)
    finite = [c[~c.isnan()] for c in (k, v)]
    k_scale, v_scale = (float(x.abs().max()) / 224.0 for x in finite)
    k8 = (k / k_scale).clamp(-448, 448).to(FP8)  # NaN stays NaN (E4M3 S.1111.111)
    v8 = (v / v_scale).clamp(-448, 448).to(FP8)
    q = torch.randn(sum(c for c, _ in pairs), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *itertools.accumulate(c for c, _ in pairs)], dtype=torch.int32)
    return q, k8, v8, cu, table, torch.tensor(seq_lens, dtype=torch.int32), k_scale, v_scale


def dequantized_attention(q, k8, v8, cu, table, seq_lens, k_scale, v_scale, scale=None):
    """Attention over the dequantized cache (k_scale * k8, v_scale * v8) in float64."""
    kd, vd = k8.double() * k_scale, v8.double() * v_scale
    out, lse = reference.flash_prefill(
        q.double(), kd, vd, cu, table, seq_lens, scale, return_lse=True
    )
    return out, lse


CASES = [  # (pairs (chunk, cached prefix), Hq, Hkv, D, block size)
    ([(1, 0)], 1, 1, 64, 16),
    ([(7, 0), (3, 5), (0, 4), (13, 31)], 4, 1, 64, 5),
    ([(33, 0), (1, 40)], 8, 2, 128, 16),
    ([(17, 3), (2, 0)], 6, 3, 96, 1),  # D outside kernel support: the reference alone
    ([(130, 0), (5, 129)], 8, 8, 128, 32),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_cache_equals_the_dequantized_cache(case, dtype):
    pairs, hq, hkv, d, bs = CASES[case]
    q, k8, v8, cu, table, seq, ks, vs = fp8_batch(pairs, hq, hkv, d, bs, dtype, seed=case)
    want, want_lse = dequantized_attention(q, k8, v8, cu, table, seq, ks, vs)
    for run in (reference.flash_prefill, pagedkern.flash_prefill):  # the op: reference on CPU
        out = poisoned(q.shape, dtype, "cpu")
        _, lse = run(q, k8, v8, cu, table, seq, out=out, return_lse=True, k_scale=ks, v_scale=vs)
        assert_close_to(out, want, dtype)
        assert not torch.isnan(lse).any()
        torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=0)


def test_scales_fold_exactly_like_the_model_did():
    """k_scale into the softmax scale and v_scale on the output: what model/llama.py did by hand
    (scale * k_scale, then out * v_scale), to fp32 rounding."""
    q, k8, v8, cu, table, seq, ks, vs = fp8_batch([(9, 4), (20, 0)], 4, 2, 64, 8, torch.float32, 1)
    got = reference.flash_prefill(q, k8, v8, cu, table, seq, 0.1, k_scale=ks, v_scale=vs)
    by_hand = reference.flash_prefill(q, k8, v8, cu, table, seq, 0.1 * ks) * vs
    torch.testing.assert_close(got, by_hand, atol=1e-6, rtol=1e-5)
    want, _ = dequantized_attention(q, k8, v8, cu, table, seq, ks, vs, scale=0.1)
    assert_close_to(got, want, torch.float32)


def test_default_scales_read_the_stored_values():
    q, k8, v8, cu, table, seq, _, _ = fp8_batch([(11, 2)], 2, 1, 64, 4, torch.bfloat16, 2)
    want, _ = dequantized_attention(q, k8, v8, cu, table, seq, 1.0, 1.0)
    assert_close_to(pagedkern.flash_prefill(q, k8, v8, cu, table, seq), want, torch.bfloat16)


def test_nan_in_a_visible_slot_reaches_the_output():
    """NaN never passes silently: a NaN stored in a key the queries see makes their output NaN
    (the other sequence's output stays finite)."""
    q, k8, v8, cu, table, seq, ks, vs = fp8_batch([(4, 0), (3, 0)], 2, 1, 64, 4, torch.bfloat16, 3)
    k8 = k8.clone()
    k8[int(table[0, 0]), 0, 0, 0] = float("nan")  # key 0 of sequence 0: visible to all its rows
    out = pagedkern.flash_prefill(q, k8, v8, cu, table, seq, k_scale=ks, v_scale=vs)
    assert torch.isnan(out[:4]).all(dim=-1).all()
    assert not torch.isnan(out[4:]).any()


def _args():
    q, k8, v8, cu, table, seq, _, _ = fp8_batch([(5, 3)], 4, 2, 64, 4, torch.bfloat16, 4)
    return q, k8, v8, cu, table, seq


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: (a[0].double(), *a[1:]), TypeError, r"q \(shape \(5, 4, 64\), dtype float64"),
        (lambda a: (a[0], a[1], a[2].bfloat16(), *a[3:]), TypeError, r"v_cache .*bfloat16.*both"),
        (lambda a: (a[0], a[1].half(), *a[2:]), TypeError, r"k_cache .*float16.*both caches"),
        (lambda a: (a[0], a[1][:, :1], *a[2:]), ValueError, r"k_cache \(shape \(\d+, 1, 4, 64\)"),
        (lambda a: (a[0][:, :3], *a[1:]), ValueError, r"q \(shape \(5, 3, 64\).*multiple"),
        (lambda a: (a[0], a[1], a[2][..., :32], *a[3:]), ValueError, r"v_cache .*float8_e4m3fn"),
    ],
    ids=["q-fp64", "v-bf16", "k-fp16", "kv-heads", "gqa", "v-shape"],
)
def test_fp8_argument_errors_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        pagedkern.flash_prefill(*change(_args()))


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "2"])
def test_bad_dequantization_scales_are_rejected(name, bad):
    with pytest.raises(ValueError, match=name):
        pagedkern.flash_prefill(*_args(), **{name: bad})


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scales_on_a_16bit_cache_are_rejected(name):
    """One convention for every attention op (paged_attention, rope_and_cache): scales are an
    fp8 cache's, None meaning 1; given with a bfloat16 cache they are an error, not ignored."""
    q, k8, v8, cu, table, seq = _args()
    k, v = k8.bfloat16(), v8.bfloat16()
    with pytest.raises(ValueError, match=f"{name} applies to an fp8"):
        pagedkern.flash_prefill(q, k, v, cu, table, seq, **{name: 0.5})
    out = pagedkern.flash_prefill(q, k, v, cu, table, seq, **{name: None})
    assert torch.equal(out, pagedkern.flash_prefill(q, k, v, cu, table, seq))


def test_engine_policy_keeps_flash_prefill_on_its_kernel_with_an_fp8_cache(monkeypatch):
    """engine/kernel_policy.py: an fp8 cache no longer sends flash_prefill to the reference."""
    import warnings

    from pagedkern.engine import kernel_policy
    from pagedkern.ops import launch

    monkeypatch.setattr(launch, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel_policy.decode_graphs(
            device_type="cuda",
            backend="auto",
            dtype="bfloat16",
            head_dim=128,
            block_size=16,
            vocab=1000,
            requested=None,
            kv_cache_dtype="fp8",
        )
    fallbacks = [str(w.message) for w in caught if "runs the PyTorch reference" in str(w.message)]
    assert not [m for m in fallbacks if "flash_prefill" in m], fallbacks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_gpu_comparison_with_the_16bit_kernel_runs_on_the_cpu(monkeypatch, head_dim, dtype):
    # test_flash_prefill_fp8_gpu.py's comparison, on the op's CPU path (the reference): its
    # calls are the GPU test's (the first GPU run lost 24 tests to a 16-bit call given k_scale).
    import test_flash_prefill_fp8_gpu as gpu_test
    import test_flash_prefill_gpu

    monkeypatch.setattr(test_flash_prefill_gpu, "DEVICE", "cpu")  # make_batch's device
    pairs = [(1, 0), (7, 15), (40, 16), (33, 0)]
    batch, (ks, vs) = gpu_test.fp8_batch(pairs, 8, head_dim, dtype, 16, seed=head_dim)
    assert batch[1].device.type == "cpu" and batch[1].dtype == FP8
    gpu_test.compare_with_the_16bit_kernel(batch, ks, vs, head_dim, dtype)
