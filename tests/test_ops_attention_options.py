"""The attention options through ops.paged_attention / ops.flash_prefill: validated, passed to
the reference, and sent to a kernel only where it has them (the decode kernel has all three,
tests/test_attention_options_emulated.py; the prefill kernel none yet): for flash_prefill the
"cuda" backend refuses, "auto" runs the reference on CUDA arrays with one warning, and the
engine's support table marks it (CPU only: the kernel path is reached as test_kernel_support
reaches it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fake_cuda_array import FakeCudaArray

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
    assert torch.equal(got, reference.paged_attention(q, k, v, tables, lens, **OPTIONS))
    assert not torch.equal(got, reference.paged_attention(q, k, v, tables, lens))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    got = pagedkern.flash_prefill(q, k, v, cu, tables, lens, **OPTIONS)
    assert torch.equal(got, reference.flash_prefill(q, k, v, cu, tables, lens, **OPTIONS))


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=2.5), "sliding_window"),
        (dict(sliding_window=True), "sliding_window"),
        (dict(soft_cap=0.0), "soft_cap"),
        (dict(soft_cap=float("nan")), "soft_cap"),
        (dict(soft_cap=float("inf")), "soft_cap"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks"),
    ],
)
def test_bad_options_are_refused(bad, words):
    q, k, v, tables, lens = _inputs()
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
    "option, words",
    [(dict(sliding_window=4), "a sliding window"), (dict(soft_cap=50.0), "logit soft-capping")],
)
def test_the_strict_backend_refuses_options_the_kernels_lack(option, words):
    assert support.attention_options("paged_attention", **option) is None  # decode has them
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError, match=words):
        pagedkern.flash_prefill(cu_seqlens_q=FakeCudaArray((4,), "int32"), **_fake(), **option)


def test_auto_runs_the_reference_on_cuda_arrays_with_one_warning(monkeypatch):
    monkeypatch.setattr(launch, "use_reference", lambda views: False)
    monkeypatch.setattr(launch, "_warned", set())
    q, k, v, tables, lens = _inputs(torch.bfloat16)  # a dtype the kernel covers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        for _ in range(3):
            out = pagedkern.flash_prefill(q, k, v, cu, tables, lens, soft_cap=3.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "logit soft-capping" in messages[0]
    expected = reference.flash_prefill(q, k, v, cu, tables, lens, soft_cap=3.0)
    assert torch.equal(out, expected)


def test_the_support_table_marks_the_prefill_kernel_only():
    plain = support.model_support("bfloat16", 128, 16, 1000)
    assert plain["paged_attention"].supported and plain["flash_prefill"].supported
    window = support.model_support("bfloat16", 128, 16, 1000, attention={"sliding_window": 8})
    assert window["paged_attention"].supported
    assert not window["flash_prefill"].supported
    assert "sliding window" in window["flash_prefill"].reason
    assert window["rms_norm"].supported


def test_the_engine_policy_keeps_decode_graphs_for_a_soft_capped_model(monkeypatch):
    from pagedkern.engine.kernel_policy import decode_graphs

    monkeypatch.setattr(launch, "_warned", set())
    gpu = dict(device_type="cuda", dtype="bfloat16", head_dim=128, block_size=16, vocab=1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = decode_graphs(backend="auto", requested=None, **gpu, attention={"soft_cap": 50.0})
    assert on is True  # decode attention runs the kernel; only prefill falls back (warned)
    assert not any("CUDA graphs are off" in str(w.message) for w in caught)
    assert any("flash_prefill" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="logit soft-capping"):
        decode_graphs(backend="cuda", requested=None, **gpu, attention={"soft_cap": 50.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_graphs(backend="auto", requested=None, **gpu, attention={}) is True
