"""The CPU backend's dispatch and its non-attention implementations: the backend names, where
each backend sends an op's CPU tensors, the table naming every op's CPU implementation (or the
reference), the engine settings and flag, and the norms against the reference as kernels are
tested (fresh random inputs, odd shapes, outputs poisoned with NaN)."""

from __future__ import annotations

import pytest
import torch
from kernel_check import assert_close_to, poisoned

from pagedkern import ops, reference
from pagedkern.engine import EngineConfig
from pagedkern.engine.kernel_policy import decode_graphs, pick_device
from pagedkern.ops import cpu, launch
from pagedkern.ops.arrays import view


def test_the_backends():
    assert launch.BACKENDS == ("auto", "cuda", "cpu", "reference")
    with pytest.raises(ValueError, match="backend"):
        ops.set_backend("cpus")
    with pytest.raises(ValueError, match="backend"), ops.use_backend("gpu"):
        pass


def test_the_table_names_every_op():
    """Every public op is in the table: its CPU implementation or the reference's function."""
    public = {name for name in ops.__all__ if name[0].islower()} - {
        "get_backend",
        "set_backend",
        "use_backend",
    }
    missing, stale = public - set(cpu.IMPLEMENTATIONS), set(cpu.IMPLEMENTATIONS) - public
    assert not missing, (
        f"name {missing} in ops/cpu IMPLEMENTATIONS (a CPU implementation or the reference)"
    )
    assert not stale, f"ops/cpu IMPLEMENTATIONS names {stale}, which ops no longer has"
    for op, fn in cpu.IMPLEMENTATIONS.items():
        if fn is not None:
            assert getattr(cpu.implementations, op) is fn
    faster = {
        op
        for op, fn in cpu.IMPLEMENTATIONS.items()
        if fn not in (None, getattr(reference, op, None))
    }
    assert faster == {
        "flash_prefill", "paged_attention", "rms_norm", "fused_add_rms_norm", "quant_linear",
        "rope_and_cache", "silu_and_mul", "fused_moe", "sample",
    }  # fmt: skip


def test_where_each_backend_sends_cpu_tensors():
    views = [view(torch.zeros(2), "x")]
    for backend, where in (("auto", "cpu"), ("cpu", "cpu"), ("reference", "reference")):
        with ops.use_backend(backend):
            assert launch.host_backend(views) == where
            assert launch.use_reference(views)  # no CUDA kernel either way
            host = launch.host_ops(views)
            assert host is (cpu.implementations if where == "cpu" else reference)
    with ops.use_backend("cuda"), pytest.raises(ops.KernelUnsupportedError, match="CPU tensors"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8))


def test_the_norm_ops_dispatch_to_the_cpu_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu.implementations, "rms_norm", lambda *a, **kw: calls.append(a) or a[0])
    x, w = torch.randn(3, 8), torch.randn(8)
    with ops.use_backend("cpu"):
        ops.rms_norm(x, w)
    assert len(calls) == 1
    with ops.use_backend("reference"):
        assert torch.equal(ops.rms_norm(x, w), reference.rms_norm(x, w))
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8), (7, 576), (3, 5, 131)])
def test_rms_norm_matches_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    want = reference.rms_norm(x, w, 1e-5)
    out = poisoned(shape, dtype, "cpu")
    assert cpu.norm.rms_norm(x, w, 1e-5, out=out) is out
    assert_close_to(out, want, dtype)
    if dtype == torch.float32:  # the CPU decode step relies on it: the reference's bits
        assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (9, 576)])
def test_fused_add_rms_norm_matches_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    x, r = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    want_x, want_r = reference.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    got_x, got_r = cpu.norm.fused_add_rms_norm(x, r, w, 1e-6)
    assert got_x is x and got_r is r
    assert_close_to(got_r, want_r, dtype)
    assert_close_to(got_x, want_x, dtype)


def test_the_engine_setting_and_device():
    assert EngineConfig(backend="cpu").backend == "cpu"
    with pytest.raises(ValueError, match="backend"):
        EngineConfig(backend="cpus")
    assert pick_device("cpu") == torch.device("cpu")
    settings = dict(dtype="float16", head_dim=64, block_size=16, vocab=100, requested=None)
    with pytest.raises(ValueError, match="'cpu'"):
        decode_graphs(device_type="cuda", backend="cpu", **settings)
    assert decode_graphs(device_type="cpu", backend="cpu", **settings) is False


def test_the_flag_comes_from_the_setting():
    from pagedkern.serving.cli.args import build_parser
    from pagedkern.serving.cli.config_from_flags import engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args(["--backend", "cpu", "hi"])).backend == "cpu"
    assert engine_config(parser.parse_args(["hi"])).backend == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "cpus", "hi"])
