"""The CPU backend's layer tail in one C++ call (ops/cpu/layer_tail.py, csrc/cpu/layer_tail.cpp)
against the reference ops one by one: random int4 / int8 weights, odd row counts, biases, SiLU
and GeGLU (GELU-tanh) MLPs, sandwich norms, activations whose SiLU / tanh span e^x's whole
range, the output poisoned with NaN beforehand; a row's
bits independent of the other rows and the thread count; the layers and variants it declines;
and a model's forward and greedy tokens with the tail fused and not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkern import ops, reference
from pagedkern.model.attention_metadata import SequenceChunk, build_batch
from pagedkern.model.loading import load_model
from pagedkern.model.quantized_linear import quantize_int4, quantize_int8
from pagedkern.model.weights import LayerWeights
from pagedkern.ops.cpu import layer_tail, quant_gemv
from pagedkern.ops.variants import use_kernels
from pagedkern.reference.quant_gemm import quant_linear as exact_linear

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")

HIDDEN, INTER, HEADS, HEAD_DIM = 96, 160, 3, 32
Q_SIZE = HEADS * HEAD_DIM


def _quantize(w: torch.Tensor, fmt: str):
    return quantize_int8(w) if fmt == "int8" else quantize_int4(w, 32)


def _layer(
    fmt: str, bias: bool, seed: int = 0, scale: float = 1.0, sandwich: bool = False
) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return _quantize(torch.randn(n, k, generator=g) * scale / k**0.5, fmt)

    def b(n):
        return torch.randn(n, generator=g) * 0.1 if bias else None

    return LayerWeights(
        input_norm=torch.rand(HIDDEN, generator=g) + 0.5,
        qkv=None,
        o=w(HIDDEN, Q_SIZE),
        post_norm=torch.rand(HIDDEN, generator=g) + 0.5,
        gate_up=w(2 * INTER, HIDDEN),
        down=w(HIDDEN, INTER),
        o_bias=b(HIDDEN),
        gate_up_bias=b(2 * INTER),
        down_bias=b(HIDDEN),
        attn_out_norm=torch.rand(HIDDEN, generator=g) + 0.5 if sandwich else None,
        mlp_out_norm=torch.rand(HIDDEN, generator=g) + 0.5 if sandwich else None,
    )


def _tail(act: str = "silu") -> layer_tail.LayerTail:
    tail = layer_tail.LayerTail(HIDDEN, INTER, Q_SIZE, act, 1e-5).for_step()
    assert tail is not None
    return tail


MLPS = {"silu": ("silu", False), "geglu, sandwich norms": ("gelu_tanh", True)}


def _reference(attn, residual, layer, next_norm, eps=1e-5, act="silu"):
    """The model's layer_tail as the reference ops compute it (residual updated in place), the
    GEMMs exact (float64) over the weights as the C++ GEMV stores them (int4: fp16 scales)."""

    def linear(x, w, b):
        return exact_linear(x, w, b, torch.float16 if w.format == "int4" else None)

    h = linear(attn.view(attn.shape[0], -1), layer.o, layer.o_bias)
    if layer.attn_out_norm is not None:
        h = reference.rms_norm(h, layer.attn_out_norm, eps)
    h, residual = reference.fused_add_rms_norm(h, residual, layer.post_norm, eps)
    gate_up = linear(h, layer.gate_up, layer.gate_up_bias)
    mlp = reference.gelu_tanh_and_mul if act == "gelu_tanh" else reference.silu_and_mul
    h = linear(mlp(gate_up), layer.down, layer.down_bias)
    if layer.mlp_out_norm is not None:
        h = reference.rms_norm(h, layer.mlp_out_norm, eps)
    return reference.fused_add_rms_norm(h, residual, next_norm, eps)


def _inputs(rows: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(100 + seed)
    attn = torch.randn(rows, HEADS, HEAD_DIM, generator=g) * scale
    residual = torch.randn(rows, HIDDEN, generator=g)
    next_norm = torch.rand(HIDDEN, generator=g) + 0.5
    return attn, residual, next_norm


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mlp", MLPS)
def test_the_fused_tail_computes_the_reference_ops(fmt, rows, bias, mlp):
    act, sandwich = MLPS[mlp]
    layer = _layer(fmt, bias, seed=rows, sandwich=sandwich)
    attn, residual, next_norm = _inputs(rows, seed=rows)
    want_h, want_residual = _reference(attn, residual.clone(), layer, next_norm, act=act)
    out = torch.full((rows, HIDDEN), float("nan"))
    got = _tail(act)(attn, residual, layer, next_norm, out=out)
    assert got is not None and got[0] is out and got[1] is residual
    assert not out.isnan().any()
    # the C++ GEMV's activations are 16 bits per block of 32 (~2e-5 of a GEMM's |terms|)
    torch.testing.assert_close(residual, want_residual, rtol=1e-4, atol=5e-4)
    torch.testing.assert_close(out, want_h, rtol=1e-4, atol=5e-4)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("mlp", MLPS)
def test_the_fused_tail_matches_the_cpu_ops_closely(fmt, mlp):
    """Against the CPU backend's own ops (the same C++ GEMV): only the norm's sums and e^x
    round differently; activations large enough that SiLU's argument (GELU's tanh) spans
    -100..100."""
    act, sandwich = MLPS[mlp]
    layer = _layer(fmt, bias=True, seed=3, scale=40.0, sandwich=sandwich)
    attn, residual, next_norm = _inputs(9, seed=3, scale=3.0)
    with ops.use_backend("cpu"):
        h = ops.quant_linear(attn.view(9, -1), layer.o, layer.o_bias)
        if sandwich:
            h = ops.rms_norm(h, layer.attn_out_norm, 1e-5)
        want_residual = residual.clone()
        h, _ = ops.fused_add_rms_norm(h, want_residual, layer.post_norm, 1e-5)
        gate_up = ops.quant_linear(h, layer.gate_up, layer.gate_up_bias)
        assert gate_up[:, :INTER].abs().max() > 80  # e^-x saturates for some
        mlp_op = ops.gelu_tanh_and_mul if act == "gelu_tanh" else ops.silu_and_mul
        h = ops.quant_linear(mlp_op(gate_up), layer.down, layer.down_bias)
        if sandwich:
            h = ops.rms_norm(h, layer.mlp_out_norm, 1e-5)
        want_h, _ = ops.fused_add_rms_norm(h, want_residual, next_norm, 1e-5)
    got_h, got_residual = _tail(act)(attn, residual, layer, next_norm)
    # (a last-bit difference before a GEMV can move its 16-bit activation rounding: ~3e-5 of
    # the block's largest value)
    for got, want in ((got_residual, want_residual), (got_h, want_h)):
        torch.testing.assert_close(got, want, rtol=0, atol=3e-5 * want.abs().max().item())


def test_a_rows_bits_depend_on_its_own_inputs_only():
    layer = _layer("int4", bias=True, seed=5)
    attn, residual, next_norm = _inputs(6, seed=5)
    torch.set_num_threads(2)  # (restored below) the GEMVs and row passes split over a team
    try:
        many_h, many_res = _tail()(attn, residual.clone(), layer, next_norm)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for r in (0, 4):
                h, res = _tail()(attn[r : r + 1].clone(), residual[r : r + 1].clone(), layer,
                                 next_norm)  # fmt: skip
                assert torch.equal(h[0], many_h[r]) and torch.equal(res[0], many_res[r])
    finally:
        torch.set_num_threads(1)


def test_nan_in_a_row_stays_in_that_row():
    layer = _layer("int8", bias=False, seed=6)
    attn, residual, next_norm = _inputs(3, seed=6)
    residual[1, 7] = float("nan")
    h, _ = _tail()(attn, residual, layer, next_norm)
    assert h[1].isnan().all() and not h[[0, 2]].isnan().any()


@pytest.mark.parametrize(
    "change",
    [
        dict(attn_out_norm=torch.ones(HIDDEN, dtype=torch.bfloat16)),
        dict(mlp_out_norm=torch.ones(HIDDEN + 1)),
        dict(router=torch.ones(4, HIDDEN)),
        dict(down=torch.randn(HIDDEN, INTER)),  # a float weight
        dict(post_norm=torch.ones(HIDDEN, dtype=torch.bfloat16)),
        dict(o_bias=torch.ones(HIDDEN, dtype=torch.bfloat16)),
    ],
    ids=[
        "bf16_attn_out_norm",
        "short_mlp_out_norm",
        "experts",
        "float_down",
        "bf16_norm",
        "bf16_bias",
    ],
)
def test_layers_it_does_not_compute_are_declined(change):
    layer = dataclasses.replace(_layer("int4", bias=False), **change)
    attn, residual, next_norm = _inputs(2, seed=7)
    before = residual.clone()
    assert _tail()(attn, residual, layer, next_norm) is None
    assert torch.equal(residual, before)  # untouched: the ops run instead


def test_other_activations_bf16_rows_and_other_variants_are_declined():
    layer = _layer("int4", bias=False)
    attn, residual, next_norm = _inputs(2, seed=8)
    exact_gelu = layer_tail.LayerTail(HIDDEN, INTER, Q_SIZE, "gelu", 1e-5).for_step()
    assert exact_gelu(attn, residual, layer, next_norm) is None
    assert _tail()(attn.bfloat16(), residual.bfloat16(), layer, next_norm) is None
    for variant in (dict(cpu_layer_tail="ops"), dict(cpu_quant_linear="int_pack")):
        with use_kernels(**variant):
            assert layer_tail.LayerTail(HIDDEN, INTER, Q_SIZE, "silu", 1e-5).for_step() is None


def test_without_the_cpu_module_the_ops_run(monkeypatch):
    monkeypatch.setattr(quant_gemv, "available", lambda: False)
    assert layer_tail.LayerTail(HIDDEN, INTER, Q_SIZE, "silu", 1e-5).for_step() is None


def test_mismatched_rows_and_outputs_are_refused():
    layer = _layer("int4", bias=False)
    attn, residual, next_norm = _inputs(3, seed=9)
    with pytest.raises(ValueError, match="rows"):
        _tail()(attn[:2], residual, layer, next_norm)
    with pytest.raises(ValueError, match="out"):
        _tail()(attn, residual, layer, next_norm, out=torch.empty(3, HIDDEN + 1))


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_models_forward_fuses_its_tails_and_agrees_with_the_ops(
    quantization, monkeypatch, kernels
):
    kernels(cpu_decoder="layers")  # the layer loop (the one-call decoder runs the same tail)
    model, _ = load_model("synthetic:tiny", quantization=quantization)
    calls = []
    module = quant_gemv.cpu_module()
    real = module.layer_tail
    monkeypatch.setattr(module, "layer_tail", lambda **kw: calls.append(1) or real(**kw))
    ids = list(range(1, 30))
    logits = {}
    for variant in ("ops", "fused"):
        with ops.use_backend("cpu"), use_kernels(cpu_layer_tail=variant):
            kv = model.allocate_kv_cache(4, 16)
            batch, meta = build_batch([SequenceChunk(ids, 0, [0, 1])], 16)
            logits[variant] = model(batch, meta, kv)
    assert len(calls) == model.config.num_layers  # every layer of the fused forward
    assert torch.isfinite(logits["fused"]).all()
    torch.testing.assert_close(logits["fused"], logits["ops"], rtol=1e-4, atol=5e-4)
    assert torch.equal(logits["fused"].argmax(-1), logits["ops"].argmax(-1))
