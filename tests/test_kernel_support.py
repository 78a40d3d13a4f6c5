"""Kernel support is one explicit decision per op, and nothing falls back silently: the "cuda"
backend raises where no kernel covers the arguments, "auto" warns once per (op, reason), and the
engine decides at start-up (refuse, or CUDA graphs off with a warning) instead of crashing in
graph capture. CPU only: the kernel path is reached by monkeypatching the device check."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
from fake_cuda_array import FakeCudaArray

import pagedkern
from pagedkern.engine import Engine, EngineConfig, kernel_policy
from pagedkern.engine.kernel_policy import decode_graphs
from pagedkern.ops import launch, support
from pagedkern.ops.support import KernelUnsupportedError


def test_each_op_has_an_explicit_decision_with_a_reason():
    assert support.paged_attention("bfloat16", 128, 16) == (True, "")
    for args, words in [
        (("float32", 128, 16), "dtype float32"),
        (("float16", 96, 16), "head_dim 96"),
        (("bfloat16", 64, 24), "block_size 24"),
    ]:
        supported, reason = support.paged_attention(*args)
        assert not supported and words in reason
    assert support.flash_prefill("float16", 64).supported
    assert "head_dim 96" in support.flash_prefill("bfloat16", 96).reason
    assert support.flash_prefill("bfloat16", 256).supported  # path 1's 64-row work items
    assert "fp8" in support.flash_prefill("bfloat16", 256, "float8_e4m3fn").reason
    assert support.flash_prefill("float16", 128, "float8_e4m3fn").supported
    assert support.sample("float32", 128256).supported
    assert not support.sample("float32", 1 << 23).supported
    assert support.elementwise("float32").supported
    # the op modules expose the same decision their dispatch uses
    paged_attention = importlib.import_module("pagedkern.ops.paged_attention")
    flash_prefill = importlib.import_module("pagedkern.ops.flash_prefill")
    assert paged_attention.kernel_support("float32", 64, 16) == support.paged_attention(
        "float32", 64, 16
    )
    assert flash_prefill.kernel_support("float16", 96) == support.flash_prefill("float16", 96)


def _attention_args(dtype="float16", d=64, block_size=16):
    return dict(
        q=FakeCudaArray((3, 8, d), dtype),
        k_cache=FakeCudaArray((10, 2, block_size, d), dtype),
        v_cache=FakeCudaArray((10, 2, block_size, d), dtype),
        block_tables=FakeCudaArray((3, 4), "int32"),
        seq_lens=FakeCudaArray((3,), "int32"),
    )


@pytest.mark.parametrize(
    "changes, reason",
    [(dict(dtype="float32"), "dtype float32"), (dict(d=96), "head_dim 96"),
     (dict(block_size=24), "block_size 24")],
)  # fmt: skip
def test_cuda_backend_raises_instead_of_falling_back(changes, reason):
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError) as info:
        pagedkern.paged_attention(**_attention_args(**changes))
    assert "paged_attention" in str(info.value) and reason in str(info.value)
    args = _attention_args(**changes)
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError, match="flash_prefill"):
        if changes.get("block_size") == 24:  # flash prefill covers any block size: D = 96
            args = _attention_args(d=96)
        pagedkern.flash_prefill(cu_seqlens_q=FakeCudaArray((4,), "int32"), **args)


def test_fused_moe_kernel_covers_half_dtypes_and_graphs_follow_the_table(monkeypatch):
    args = (
        FakeCudaArray((3, 16), "float32"), FakeCudaArray((3, 4), "float32"),
        FakeCudaArray((4, 2 * 8, 16), "float32"), FakeCudaArray((4, 16, 8), "float32"), 2,
    )  # fmt: skip
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError, match="fused_moe"):
        pagedkern.ops.fused_moe(*args)
    assert support.fused_moe("bfloat16").supported and support.fused_moe("float16", 128).supported
    assert "513 experts" in support.fused_moe("bfloat16", 513).reason
    assert "float32" in support.fused_moe("float32").reason
    decisions = support.model_support("bfloat16", 128, 16, 1000, moe=True)
    assert decisions["fused_moe"].supported and "fused_moe" not in support.model_support(
        "bfloat16", 128, 16, 1000
    )
    gpu = dict(device_type="cuda", dtype="bfloat16", head_dim=128, block_size=16, vocab=1000)
    assert decode_graphs(backend="cuda", requested=None, moe=True, **gpu) is True
    # a MoE layer outside the kernel: refused under "cuda", graphs off under "auto"
    unsupported = support.KernelSupport(False, "a test's refusal")
    monkeypatch.setattr(support, "fused_moe", lambda dtype, experts=None: unsupported)
    monkeypatch.setattr(launch, "_warned", set())
    with pytest.raises(ValueError, match="fused_moe"):
        decode_graphs(backend="cuda", requested=None, moe=True, **gpu)
    with pytest.raises(ValueError, match="fused_moe"):
        decode_graphs(backend="auto", requested=True, moe=True, **gpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert decode_graphs(backend="auto", requested=None, moe=True, **gpu) is False
    assert any("CUDA graphs are off" in str(w.message) for w in caught)


def test_cuda_backend_refuses_cpu_tensors():
    with launch.use_backend("cuda"), pytest.raises(KernelUnsupportedError, match="CPU tensors"):
        pagedkern.rms_norm(torch.ones(2, 8), torch.ones(8))


def test_auto_fallback_on_cuda_arrays_warns_once_per_op_and_reason(monkeypatch):
    # CPU tensors standing in for CUDA ones: the device check says "not the reference".
    monkeypatch.setattr(launch, "use_reference", lambda views: False)
    monkeypatch.setattr(launch, "_warned", set())
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)  # float32: outside the kernel
    k_cache = torch.randn(6, 2, 16, 64, generator=g)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out = pagedkern.paged_attention(q, k_cache, k_cache, tables, lens)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "paged_attention runs the PyTorch reference" in messages[0]
    assert "dtype float32" in messages[0]
    expected = pagedkern.reference.paged_attention(q, k_cache, k_cache, tables, lens)
    torch.testing.assert_close(out, expected)


GPU_CONFIG = dict(device_type="cuda", dtype="bfloat16", head_dim=64, block_size=16, vocab=49152)


def _policy(**changes):
    return decode_graphs(**{**GPU_CONFIG, "backend": "auto", "requested": None, **changes})


def test_engine_policy_supported_configuration_captures_graphs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _policy() is True
        assert _policy(backend="cuda") is True
        assert _policy(requested=False) is False


@pytest.mark.parametrize(
    "changes, words",
    [(dict(dtype="float32"), "dtype float32"), (dict(block_size=24), "block_size 24")],
)
def test_engine_policy_strict_backend_refuses_at_start(changes, words):
    with pytest.raises(ValueError) as info:
        _policy(backend="cuda", **changes)
    assert "paged_attention" in str(info.value) and words in str(info.value)
    assert "backend 'auto'" in str(info.value)


def test_engine_policy_auto_turns_graphs_off_with_a_warning(monkeypatch):
    monkeypatch.setattr(launch, "_warned", set())
    with pytest.warns(RuntimeWarning) as caught:
        assert _policy(block_size=24) is False
    messages = [str(w.message) for w in caught]
    assert any("paged_attention runs the PyTorch reference" in m for m in messages)
    assert any("CUDA graphs are off because paged_attention (block_size 24" in m for m in messages)
    with pytest.raises(ValueError, match="cuda_graphs=True, but decode steps cannot be captured"):
        _policy(block_size=24, requested=True)


def test_engine_policy_prefill_only_gap_keeps_graphs(monkeypatch):
    # D = 256 over an fp8 cache: decode has a kernel, prefill does not; decode graphs stay on,
    # prefill warns.
    monkeypatch.setattr(launch, "_warned", set())
    with pytest.warns(RuntimeWarning, match="flash_prefill runs the PyTorch reference") as caught:
        assert _policy(head_dim=256, kv_cache_dtype="fp8") is True
    assert not any("CUDA graphs are off" in str(w.message) for w in caught)


def test_fp8_kv_cache_decisions():
    fp8 = support.FP8_KV_DTYPE
    assert support.paged_attention("bfloat16", 128, 16, fp8) == (True, "")
    assert support.rope_and_cache("float16", fp8) == (True, "")
    assert support.rope_and_cache("float32") == (True, "")
    supported, reason = support.rope_and_cache("float32", fp8)
    assert not supported and "fp8 (E4M3) KV cache with float32" in reason
    assert not support.paged_attention("float32", 128, 16, fp8).supported


def test_engine_policy_fp8_cache_runs_every_attention_kernel(monkeypatch):
    # rope_and_cache writes E4M3 pages, paged_attention and flash_prefill read them: with 16-bit
    # activations nothing falls back, decode graphs stay on and backend "cuda" is accepted;
    # fp32 activations have no fp8 kernel.
    monkeypatch.setattr(launch, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _policy(kv_cache_dtype="fp8") is True
        assert _policy(kv_cache_dtype="fp8", backend="cuda") is True
    assert not [w for w in caught if "PyTorch reference" in str(w.message)]
    with pytest.raises(ValueError, match=r"rope_and_cache \(an fp8 \(E4M3\) KV cache with float32"):
        _policy(kv_cache_dtype="fp8", backend="cuda", dtype="float32")


def test_engine_policy_cpu_and_reference():
    assert _policy(device_type="cpu") is False
    assert _policy(device_type="cpu", requested=True) is True  # eager static-buffer path
    assert _policy(backend="reference") is False
    with pytest.raises(ValueError, match="needs the CUDA kernels"):
        _policy(backend="reference", requested=True)
    with pytest.raises(ValueError, match="backend 'cuda' runs the CUDA kernels only"):
        _policy(device_type="cpu", backend="cuda")


def test_the_engine_consults_the_policy_at_start(monkeypatch):
    calls = []

    def spy(**kwargs):
        calls.append(kwargs)
        return False

    monkeypatch.setattr(kernel_policy, "decode_graphs", spy)  # step_graphs calls it
    config = EngineConfig(model="synthetic:tiny", backend="reference", num_blocks=64, block_size=8)
    engine = Engine.from_config(config)
    assert engine.runner.graphs is None
    (call,) = calls
    cfg = engine.model.config
    assert call == dict(
        device_type="cpu",
        backend="reference",
        dtype=str(engine.model.dtype).removeprefix("torch."),
        head_dim=cfg.head_dim,
        block_size=8,
        vocab=cfg.vocab_size,
        requested=None,
        kv_cache_dtype="auto",
        attention={"sliding_window": None, "soft_cap": None, "sinks": None},
        moe=False,
    )


def test_nan_never_reaches_a_kernel_as_a_scale():
    for bad in (math.nan, math.inf, -1.0, 0.0, True):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            pagedkern.paged_attention(**_attention_args(), scale=bad)
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            pagedkern.flash_prefill(
                cu_seqlens_q=FakeCudaArray((4,), "int32"), **_attention_args(), scale=bad
            )
