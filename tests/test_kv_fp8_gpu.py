"""The fp8 (E4M3) KV cache in the CUDA kernels on the GPU: rope_and_cache's quantizing write bit
for bit against reference.rope_and_cache on the same GPU tensors (NaN may differ in sign only),
and paged_attention over fp8 pages (every variant) against the fp32 reference over the same fp8
cache and against attention over the dequantized cache; shuffled tables, NaN in unowned slots,
poisoned outputs, split-KV on and off, CUDA-graph capture."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_check import assert_close_to, assert_same_e4m3, poisoned
from test_paged_attention_gpu import paged_cache

import pagedkern
from pagedkern import reference
from pagedkern.reference import cos_sin_cache
from pagedkern.reference.rope import quantize_e4m3

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FP8 = torch.float8_e4m3fn


@pytest.fixture
def variant(request, kernels):
    """The attention tests run on every kernel variant (PAGEDKERN_KERNELS=paged_attention:...)."""
    kernels(paged_attention=request.param)
    return request.param


def fp8_cache(seq_lens, hkv, block_size, d, seed, k_scale, v_scale):
    """paged_cache's shuffled pages quantized to E4M3 (NaN slots stay NaN, 0x7F)."""
    k, v, tables = paged_cache(seq_lens, hkv, block_size, d, torch.float32, seed)
    return quantize_e4m3(2 * k, k_scale), quantize_e4m3(v, v_scale), tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, misaligned", [(128, False), (64, True), (256, False)])
def test_rope_and_cache_fp8_write_is_bit_exact(dtype, d, misaligned):
    g = torch.Generator(device=DEVICE).manual_seed(d)
    tokens, hq, hkv, block_size = 1001, 32, 8, 16
    off = 1 if misaligned else 0
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d + off, generator=g, device=DEVICE) * 8).to(dtype)
    q = qkv[:, off : off + hq * d].view(tokens, hq, d)
    k = qkv[:, off + hq * d : off + (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, off + (hq + hkv) * d :].view(tokens, hkv, d)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE, dtype=torch.int32)
    blocks = tokens // block_size + 4
    slots = torch.randperm(blocks * block_size, generator=g, device=DEVICE)[:tokens].int()
    slots[::7] = -1
    cos_sin = cos_sin_cache(d, 8192, device=DEVICE)
    k_cache = torch.full((blocks, hkv, block_size, d), math.nan, device=DEVICE).to(FP8)
    v_cache = k_cache.clone()
    scales = dict(k_scale=0.031, v_scale=0.0077)
    expected = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    reference.rope_and_cache(*expected[:3], positions, cos_sin, *expected[3:], slots, **scales)
    pagedkern.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots, **scales)
    for got, want in zip((q, k, v), expected[:3], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert_same_e4m3(k_cache, expected[3])
    assert_same_e4m3(v_cache, expected[4])


def check_fp8(seq_lens, dtype, d, block_size, hq, hkv, num_splits=None, seed=0):
    k_scale, v_scale = 0.02, 0.006
    k_cache, v_cache, tables = fp8_cache(seq_lens, hkv, block_size, d, seed, k_scale, v_scale)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), hq, d, generator=g, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, dtype, DEVICE)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    result, lse = pagedkern.paged_attention(
        q, k_cache, v_cache, tables, lens, out=out, return_lse=True, num_splits=num_splits,
        **scales,
    )  # fmt: skip
    assert result is out
    ref, ref_lse = reference.paged_attention(
        q.float(), k_cache, v_cache, tables, lens, return_lse=True, **scales
    )
    assert_close_to(out, ref, dtype)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    deq = reference.paged_attention(
        q.double(), k_cache.double() * k_scale, v_cache.double() * v_scale, tables, lens
    )
    assert_close_to(out, deq, dtype)
    padding = lens == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


LENGTHS = [1, 15, 16, 17, 255, 1000, 4097, 16384, 0]


@pytest.mark.parametrize("variant", ["auto", "simt", "mma"], indirect=True)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_lengths_with_and_without_split_kv(num_splits, dtype, variant):
    check_fp8(LENGTHS, dtype, 128, 16, 32, 8, num_splits)


@pytest.mark.parametrize(
    "d, block_size, hq, hkv",
    [(64, 16, 8, 8), (64, 32, 32, 4), (128, 8, 32, 32), (128, 64, 64, 8), (256, 16, 16, 2),
     (128, 16, 40, 5), (64, 128, 14, 2)],
)  # fmt: skip
@pytest.mark.parametrize("variant", ["auto", "simt", "mma"], indirect=True)
def test_fp8_head_dims_block_sizes_and_groups(d, block_size, hq, hkv, variant):
    check_fp8([3, 100, 513, 2049], torch.bfloat16, d, block_size, hq, hkv, seed=d + hq)


@pytest.mark.parametrize("variant", ["auto", "simt", "mma"], indirect=True)
def test_fp8_decode_is_graph_capturable(variant):
    k_scale, v_scale = 0.02, 0.006
    k_cache, v_cache, tables = fp8_cache([500, 37, 4000], 8, 16, 128, 5, k_scale, v_scale)
    q = torch.randn(3, 32, 128, device=DEVICE).bfloat16()
    lens = torch.tensor([500, 37, 4000], dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, q.dtype, DEVICE)
    kwargs = dict(out=out, max_seq_len=4096, k_scale=k_scale, v_scale=v_scale)
    pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, **kwargs)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, **kwargs)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention(q.float(), k_cache, v_cache, tables, lens, k_scale=k_scale,
                                    v_scale=v_scale)  # fmt: skip
    assert_close_to(out, ref, torch.bfloat16)


def test_engine_with_an_fp8_cache_runs_the_kernels_and_captures_decode():
    # backend auto: rope_and_cache and paged_attention on their fp8 kernels (flash_prefill on
    # the reference, warned), so decode CUDA graphs stay on and must equal eager decode; the
    # greedy answers follow the fp32 reference over its own fp8 cache.
    import warnings

    from test_engine_gpu import GREEDY, _prompts, _run, reference_argmax_agreement

    from pagedkern.engine import Engine, EngineConfig

    prompts = _prompts(12, seed=3)
    base = dict(
        model="synthetic:smollm2-135m", num_blocks=2048, max_num_seqs=16, max_model_len=2048,
        kv_cache_dtype="fp8",
    )  # fmt: skip
    answers = {}
    for name, extra in [
        ("graphs", dict(backend="auto", cuda_graphs=True)),
        ("eager", dict(backend="auto", cuda_graphs=False)),
    ]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # flash_prefill's fallback
            engine = Engine.from_config(EngineConfig(**base, **extra))
        assert engine.kv_cache.data.dtype == FP8
        if name == "graphs":
            assert engine.runner.graphs is not None and engine.runner.graphs._graphs
        answers[name] = [r.output_ids for r in _run(engine, prompts, GREEDY)]
        del engine
    same = lambda a, b: sum(x == y for x, y in zip(answers[a], answers[b], strict=True))  # noqa: E731
    # Graphs and eager run the same kernels on other launch shapes: a decode graph's block
    # tables are padded to max_model_len (paged_attention splits 2048 keys into 8 and merges;
    # eager, at the batch's width, does not split), its GEMMs see the padded batch and mixed
    # steps replay piecewise graphs padded to their token bucket. The last bits differ, and an
    # fp8 cache turns a last-bit difference of k or v that crosses an E4M3 rounding boundary
    # into a whole E4M3 step (1/16 to 1/8 relative), so greedy answers part more often than a
    # 16-bit cache (the first H200 run: 10 of 12 equal here, at least 11 in the bf16 test). Where
    # they part, they agree on most of their tokens first.
    assert same("graphs", "eager") >= len(prompts) - 2
    agreed = total = 0
    for x, y in zip(answers["graphs"], answers["eager"], strict=True):
        total += len(y)
        agreed += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    assert agreed >= 0.9 * total
    # Equal greedy answers against the reference backend are a weak measure here: the first
    # H200 runs found 2 of 12 (random weights leave many near ties, and an E4M3 step is coarse).
    # Fed back through the fp32 reference over an fp8 cache, the eager answers must be its
    # argmax at most steps (bf16 with an fp8 cache on this CPU: 91% of tokens; the same answers
    # after a corrupted prompt: 17%).
    pairs = [(list(p), list(a)) for p, a in zip(prompts, answers["eager"], strict=True)]
    agree = sum(reference_argmax_agreement(pairs, seed=0, kv_cache_dtype="fp8"))
    assert agree >= 0.8 * sum(len(a) for _, a in pairs)
