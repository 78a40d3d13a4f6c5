"""The attention options through ops.paged_attention / ops.flash_prefill: validated, passed to
the CPU implementation (and the reference), and taken by both kernels (the decode kernel:
tests/test_attention_options_emulated.py; the prefill kernel's path 1:
tests/test_attention_options_gpu.py), so the support table and the engine's start-up policy
keep both attention ops on their kernels; a fallback for another reason (dtype, head dim) passes
the options to the reference (CPU only: the kernel path is reached as test_kernel_support
reaches it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fake_cuda_array import FakeCudaArray
from kernel_check import assert_close_to, relative_error

import pagedkern
from pagedkern import reference
from pagedkern.ops import launch, support
from pagedkern.ops.support import KernelUnsupportedError


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g).to(dtype) * 4
    k_cache = torch.randn(6, 2, 16, 64, generator=g).to(dtype)
    v_cache = torch.randn(6, 2, 16, 64, generator=g).to(dtype)
    tables = torch.tensor([[0, 1, 4], [2, 3, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 5], dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens


OPTIONS = dict(sliding_window=7, soft_cap=3.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))


def test_the_ops_pass_the_options_to_the_reference():
    q, k, v, tables, lens = _inputs()
    got = pagedkern.paged_attention(q, k, v, tables, lens, **OPTIONS)
    assert_close_to(got, reference.paged_attention(q, k, v, tables, lens, **OPTIONS), torch.float32)
    assert relative_error(got, reference.paged_attention(q, k, v, tables, lens)) > 1e-2
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    got = pagedkern.flash_prefill(q, k, v, cu, tables, lens, **OPTIONS)
    want = reference.flash_prefill(q, k, v, cu, tables, lens, **OPTIONS)
    assert_close_to(got, want, torch.float32)


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=2.5), "sliding_window"),
        (dict(sliding_window=True), "sliding_window"),
        (dict(sliding_window=2**40), r"sliding_window must be an int in \[1, 2\^31\)"),
        (dict(soft_cap=0.0), "soft_cap"),
        (dict(soft_cap=float("nan")), "soft_cap"),
        (dict(soft_cap=float("inf")), "soft_cap"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks"),
    ],
)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_bad_options_are_refused(bad, words, backend):
    q, k, v, tables, lens = _inputs()
    with pagedkern.ops.use_backend(backend):
        with pytest.raises((ValueError, TypeError), match=words):
            pagedkern.paged_attention(q, k, v, tables, lens, **bad)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        with pytest.raises((ValueError, TypeError), match=words):
            pagedkern.flash_prefill(q, k, v, cu, tables, lens, **bad)


def _fake(dtype="float16"):
    return dict(
        q=FakeCudaArray((3, 8, 64), dtype),
        k_cache=FakeCudaArray((10, 2, 16, 64), dtype),
        v_cache=FakeCudaArray((10, 2, 16, 64), dtype),
        block_tables=FakeCudaArray((3, 4), "int32"),
        seq_lens=FakeCudaArray((3,), "int32"),
    )


@pytest.mark.parametrize(
    "option", [dict(sliding_window=4), dict(soft_cap=50.0), dict(sinks=torch.zeros(8))]
)
def test_both_attention_kernels_take_every_option(option):
    for kernel in ("paged_attention", "flash_prefill"):
        assert support.attention_options(kernel, **option) is None
    # the fp32 prefill kernel does not exist: the strict backend names the dtype, not the option
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError, match="float32"):
        pagedkern.flash_prefill(cu_seqlens_q=FakeCudaArray((4,), "int32"), **_fake("float32"))


def test_auto_passes_the_options_to_the_reference_it_falls_back_to(monkeypatch):
    monkeypatch.setattr(launch, "use_reference", lambda views: False)
    monkeypatch.setattr(launch, "_warned", set())
    q, k, v, tables, lens = _inputs(torch.float32)  # a dtype no attention kernel covers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        for _ in range(3):
            out = pagedkern.flash_prefill(q, k, v, cu, tables, lens, soft_cap=3.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "float32" in messages[0]
    expected = reference.flash_prefill(q, k, v, cu, tables, lens, soft_cap=3.0)
    assert_close_to(out, expected, torch.float32)  # (the CPU backend's kernel: to rounding)
    assert relative_error(out, reference.flash_prefill(q, k, v, cu, tables, lens)) > 1e-2


def test_the_support_table_keeps_both_attention_kernels_for_options():
    plain = support.model_support("bfloat16", 128, 16, 1000)
    options = {"sliding_window": 8, "soft_cap": 50.0}
    window = support.model_support("bfloat16", 128, 16, 1000, attention=options)
    for op in ("paged_attention", "flash_prefill"):
        assert plain[op].supported and window[op].supported
    fp8 = support.model_support("bfloat16", 128, 16, 1000, support.FP8_KV_DTYPE, options)
    assert fp8["paged_attention"].supported  # the decode kernel's options read fp8 pages too
    assert not fp8["flash_prefill"].supported and "fp8" in fp8["flash_prefill"].reason


def test_the_engine_policy_keeps_decode_graphs_for_a_soft_capped_model(monkeypatch):
    from pagedkern.engine.kernel_policy import decode_graphs

    monkeypatch.setattr(launch, "_warned", set())
    gpu = dict(device_type="cuda", dtype="bfloat16", head_dim=128, block_size=16, vocab=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = decode_graphs(backend="auto", requested=None, **gpu, attention={"soft_cap": 50.0})
        assert on is True
        assert decode_graphs(backend="cuda", requested=None, **gpu, attention={"soft_cap": 50.0})
        assert decode_graphs(backend="auto", requested=None, **gpu, attention={}) is True
    # a head dim the prefill kernel lacks still falls back, named as such (256 is covered)
    assert decode_graphs(
        backend="cuda", requested=None, **{**gpu, "head_dim": 256}, attention={"soft_cap": 5.0}
    )
    with pytest.raises(ValueError, match="head_dim 96"):
        decode_graphs(
            backend="cuda", requested=None, **{**gpu, "head_dim": 96}, attention={"soft_cap": 5.0}
        )
