"""A 16-bit KV cache under float32 activations (--kv-cache-dtype bfloat16 / float16, the CPU's
half-size cache): the model's element and size, the ops' checks and the CUDA support table
around it, attention over it on the CPU backend equal to the reference's over the same pages,
the engine end to end, and the CPU cache's huge-page allocation. The CPU decoder's bits over
such a cache against the layer loop: test_cpu_backend_decoder.py; the C++ writes' rounding:
test_cpu_backend_rope.py."""

from __future__ import annotations

import pytest
import torch

import pagedkern
from pagedkern import reference
from pagedkern.engine import LLM, EngineConfig, SamplingParams
from pagedkern.engine.kernel_policy import decode_graphs
from pagedkern.model import SequenceChunk, build_batch, load_model
from pagedkern.model.kv_cache import allocate_kv_cache, kv_block_bytes, kv_element
from pagedkern.ops import support
from pagedkern.ops.cpu import huge_pages
from pagedkern.serving.cli.args import build_parser

HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALVES)
def test_the_model_holds_its_cache_in_half_the_bytes(dtype):
    name = str(dtype).removeprefix("torch.")
    model, _ = load_model("synthetic:tiny", kv_cache_dtype=name)
    assert model.dtype == torch.float32 and model.kv_dtype == dtype
    cache = model.allocate_kv_cache(4, 16)
    dense = allocate_kv_cache(model.config, 4, 16, dtype=torch.float32)
    assert cache.data.dtype == dtype and cache.data.nbytes * 2 == dense.data.nbytes
    assert cache.scales is None and not cache.is_fp8


def test_the_cpu_default_is_a_float16_cache_and_float32_a_choice():
    default, _ = load_model("synthetic:tiny")
    exact, _ = load_model("synthetic:tiny", kv_cache_dtype="float32")
    assert default.dtype == exact.dtype == torch.float32
    assert default.allocate_kv_cache(2, 16).data.dtype == torch.float16
    assert exact.allocate_kv_cache(2, 16).data.dtype == torch.float32
    args = build_parser().parse_args(["--kv-cache-dtype", "float32"])
    assert args.kv_cache_dtype == "float32"


def test_the_cache_element_follows_the_activations_and_the_device():
    for device in ("cpu", "cuda"):
        assert kv_element("auto", torch.float16, device) == torch.float16
        assert kv_element("auto", torch.bfloat16, device) == torch.bfloat16
        assert kv_element("bfloat16", torch.bfloat16, device) == torch.bfloat16  # (= auto)
        assert kv_element("float16", torch.float32, device) == torch.float16
        assert kv_element("float32", torch.float32, device) == torch.float32
        with pytest.raises(ValueError, match="kv_cache_dtype float16 with torch.bfloat16"):
            kv_element("float16", torch.bfloat16, device)
        with pytest.raises(ValueError, match="float32 cache holds float32 activations only"):
            kv_element("float32", torch.bfloat16, device)
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            kv_element("int8", torch.float32, device)
    # float32 activations: a float16 cache on the CPU (llama.cpp's default), their own on CUDA
    assert kv_element("auto", torch.float32, "cpu") == torch.float16
    assert kv_element("auto", torch.float32, "cuda") == torch.float32
    assert EngineConfig(kv_cache_dtype="float16").kv_cache_dtype == "float16"
    assert EngineConfig(kv_cache_dtype="float32").kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="auto, fp8, bfloat16, float16, float32"):
        EngineConfig(kv_cache_dtype="half")
    args = build_parser().parse_args(["--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"


def test_the_cuda_kernels_read_caches_of_their_own_dtype_only():
    # a 16-bit cache under other activations runs the reference (the kernels' caches are the
    # activations' dtype or fp8); under its own dtype it is the plain case
    assert support.rope_and_cache("float32") == (True, "")  # (the kernel's fp32 rows)
    for supported, reason in (
        support.rope_and_cache("float32", "bfloat16"),
        support.paged_attention("float16", 128, 16, "bfloat16"),
        support.flash_prefill("bfloat16", 128, "float16"),
    ):
        assert not supported and "KV cache with" in reason
    supported, reason = support.rope_and_cache("float16", "bfloat16")
    assert "a bfloat16 KV cache with float16 activations" in reason
    assert support.paged_attention("bfloat16", 128, 16, "bfloat16") == (True, "")
    with pytest.raises(ValueError, match=r"rope_and_cache \(a float16 KV cache with bfloat16"):
        decode_graphs(
            device_type="cuda", dtype="bfloat16", head_dim=64, block_size=16, vocab=100,
            backend="cuda", requested=None, kv_cache_dtype="float16",
        )  # fmt: skip


def _pages(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, 64, generator=g)
    k_cache = torch.randn(6, 2, 16, 64, generator=g).to(dtype)
    v_cache = torch.randn(6, 2, 16, 64, generator=g).to(dtype)
    tables = torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor([20, 7, 32], dtype=torch.int32)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_attention_over_a_16_bit_cache_with_fp32_queries(dtype, backend):
    # Both ops read the cache's values exactly (widened to fp32): the CPU backend's kernel
    # gives the reference's answer over the same pages, to fp32 rounding.
    q, k_cache, v_cache, tables, lens = _pages(dtype)
    want = reference.paged_attention(q, k_cache.float(), v_cache.float(), tables, lens)
    out = torch.full_like(q, float("nan"))
    with pagedkern.ops.use_backend(backend):
        got = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, out=out)
        assert got.dtype == torch.float32 and not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        prefill = pagedkern.flash_prefill(q, k_cache, v_cache, cu, tables, lens)
    torch.testing.assert_close(prefill, want, rtol=1e-5, atol=1e-6)


def test_a_16_bit_cache_under_other_16_bit_queries_is_refused_by_name():
    q, k_cache, v_cache, tables, lens = _pages(torch.float16)
    with pytest.raises(TypeError, match=r"k_cache .*float16.* must have the dtype of q"):
        pagedkern.paged_attention(q.bfloat16(), k_cache, v_cache, tables, lens)
    with pytest.raises(TypeError, match=r"v_cache .*bfloat16.* must have the dtype of k_cache"):
        pagedkern.paged_attention(q, k_cache, v_cache.bfloat16(), tables, lens)


@pytest.mark.parametrize("dtype", HALVES)
def test_the_model_over_a_16_bit_cache_stays_near_fp32(dtype):
    # Two steps (a prefill, then decode rows over it): K/V rounded to 16 bits move the hidden
    # states by about their rounding (bf16 2^-9, fp16 2^-12), and the CPU backend agrees with
    # the reference over the same rounded pages.
    name = str(dtype).removeprefix("torch.")
    wide, _ = load_model("synthetic:tiny", kv_cache_dtype="float32")
    narrow, _ = load_model("synthetic:tiny", kv_cache_dtype=name)
    prompt = list(range(3, 40))
    results = {}
    for label, model, backend in (
        ("fp32", wide, "cpu"), ("cpu", narrow, "cpu"), ("reference", narrow, "reference")
    ):  # fmt: skip
        kv = model.allocate_kv_cache(8, 16)
        with pagedkern.ops.use_backend(backend):
            first = model.hidden_states(*build_batch([SequenceChunk(prompt, 0, [1, 2, 3])], 16), kv)
            step = build_batch([SequenceChunk([7], len(prompt), [1, 2, 3])], 16)
            results[label] = torch.cat([first, model.hidden_states(*step, kv)])
        assert kv.data.dtype == model.kv_dtype
    for got in results.values():
        assert not got.isnan().any()
    torch.testing.assert_close(results["cpu"], results["reference"], rtol=1e-4, atol=1e-4)
    error = (results["cpu"] - results["fp32"]).norm() / results["fp32"].norm()
    bound = 1e-2 if dtype == torch.bfloat16 else 2e-3  # (measured 3.7e-3, 4.8e-4)
    assert 0 < error < bound


@pytest.mark.parametrize("dtype", HALVES)
def test_the_engine_serves_over_a_16_bit_cache(dtype):
    name = str(dtype).removeprefix("torch.")
    llm = LLM("synthetic:tiny", kv_cache_dtype=name, device="cpu", num_blocks=16)
    try:
        assert llm.engine.kv_cache.data.dtype == dtype
        out = llm.generate(
            ["a b c d e f"] * 3, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
    finally:
        llm.close()
    assert [len(g.token_ids) for g in out] == [6, 6, 6]
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids  # greedy: one answer


def test_the_cpu_cache_is_advised_onto_huge_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *a: calls.append(a) or 0)
    shape = (3, 2, 64, 4, 16, 64)  # 6 MiB of fp32: a whole 2 MiB page inside it wherever it starts
    data = huge_pages.zeros(shape, torch.float32)
    assert data.shape == shape and data.dtype == torch.float32 and not data.any()
    ((start, length, advice),) = calls
    end = data.data_ptr() + data.numel() * 4
    assert start % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0
    assert data.data_ptr() <= start and start + length <= end and length > 0
    assert advice == 14  # MADV_HUGEPAGE
    assert huge_pages.huge_page_span(4096, 4096) is None  # no whole page inside: no advice
    calls.clear()
    config = load_model("synthetic:tiny")[0].config
    blocks = 3 * huge_pages.HUGE_PAGE // kv_block_bytes(config, 16, torch.float32) + 1
    allocate_kv_cache(config, blocks, 16)  # the model's CPU cache goes through it
    assert len(calls) == 1
