"""A mixture-of-experts layer's whole MLP in one C++ call (csrc/cpu/moe_mlp.cpp, built by
ops/cpu/moe_quant.layer_mlp, run by the layer tail and the one-call decoder): the router's fp32
GEMV, the top-k and its weights against reference.moe_route (softmax, sigmoid, softmax over the
top-k; renormalised or not; ties to the lower expert, NaN rows as torch sorts them), the whole
MLP against the float64 reference over the dequantized experts (int4 and int8, SiLU and
GELU-tanh, router bias, Qwen2-MoE's gated shared expert, odd token counts); a row's bits
independent of the batch, the thread count and the GEMV path; and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kernel_check import relative_error

from pagedkern import reference
from pagedkern.model.quantized_linear import quantize, quantize_experts
from pagedkern.ops.cpu import moe_quant, quant_gemv
from pagedkern.reference.quant_gemm import dequantize

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")


def _layer(experts, hidden, inter, fmt, shared=0, router_bias=False, seed=0):
    """A LayerWeights-like MoE layer: fp32 router, quantized stacked experts, the shared
    expert (int4/int8 gate_up and down, fp32 gate) when `shared`."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std):
        return torch.randn(*shape, generator=g) * std

    gate_up = randn(experts, 2 * inter, hidden, std=hidden**-0.5)
    down = randn(experts, hidden, inter, std=inter**-0.5)
    layer = SimpleNamespace(
        router=randn(experts, hidden, std=hidden**-0.5),
        router_bias=randn(experts, std=0.5) if router_bias else None,
        experts_gate_up=quantize_experts(gate_up, fmt, 32),
        experts_down=quantize_experts(down, fmt, 32),
        experts_gate_up_bias=None, experts_down_bias=None,
        gate_up=None, down=None, gate_up_bias=None, down_bias=None, shared_gate=None,
    )  # fmt: skip
    if shared:
        layer.gate_up = quantize(randn(2 * shared, hidden, std=hidden**-0.5), fmt, 32)
        layer.down = quantize(randn(hidden, shared, std=shared**-0.5), fmt, 32)
        layer.shared_gate = randn(1, hidden, std=hidden**-0.5)
    return layer


def _settings(threads=1, path=None, min_macs=None) -> tuple:
    """run()'s threads, parallel_min_macs, path and activation bits (16: the default)."""
    module = quant_gemv.cpu_module()
    path = module.PATHS[path or quant_gemv.best_path()]
    return threads, min_macs or quant_gemv.PARALLEL_MIN_MACS, path, 16


def _run(mlp, h: torch.Tensor, **settings) -> torch.Tensor:
    out = torch.full_like(h, float("nan"))  # poisoned: every element must be written
    mlp.run(h.data_ptr(), h.shape[0], out.data_ptr(), *_settings(**settings))
    return out


def _route(mlp, h: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((h.shape[0], top_k), -1, dtype=torch.int32)
    weights = torch.full((h.shape[0], top_k), float("nan"))
    mlp.route(h.data_ptr(), h.shape[0], ids.data_ptr(), weights.data_ptr(), 1, 1 << 40)
    return ids, weights


def _logits(layer, h: torch.Tensor) -> torch.Tensor:
    logits = h.double() @ layer.router.double().T
    return logits if layer.router_bias is None else logits + layer.router_bias.double()


def _float(w) -> torch.Tensor:
    """A quantized [N, K] weight or stacked [E, N, K] experts as the GEMV multiplies them."""
    if len(w.shape) == 2:
        return dequantize(w)
    return torch.stack([dequantize(w.expert(e)) for e in range(w.shape[0])])


def _reference(layer, h, top_k, renormalize, scoring, activation) -> torch.Tensor:
    """model/moe.py's moe_mlp in float64 over the dequantized weights."""
    x = h.double()
    out = reference.fused_moe(
        x, _logits(layer, h), _float(layer.experts_gate_up), _float(layer.experts_down), top_k,
        renormalize=renormalize, scoring=scoring, activation=activation,
    )  # fmt: skip
    if layer.gate_up is not None:
        gate, up = (x @ _float(layer.gate_up).T).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ _float(layer.down).T
        out = out + torch.sigmoid(x @ layer.shared_gate.double().T) * shared
    return out


CASES = [  # tokens, experts, top_k, hidden, inter, format, shared, router bias
    (1, 8, 2, 64, 32, "int4", 0, False),
    (3, 6, 3, 96, 64, "int8", 0, True),
    (17, 5, 1, 128, 32, "int4", 64, False),
    (5, 7, 7, 32, 96, "int8", 32, True),
    (33, 16, 4, 64, 64, "int4", 0, False),
]
ROUTINGS = [(True, "softmax"), (False, "softmax"), (False, "sigmoid"), (True, "softmax_topk")]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, fmt, shared, bias", CASES)
@pytest.mark.parametrize("renormalize, scoring", ROUTINGS)
def test_the_routing_is_the_references(tokens, experts, top_k, hidden, inter, fmt, shared,
                                       bias, renormalize, scoring):  # fmt: skip
    layer = _layer(experts, hidden, inter, fmt, shared, bias, seed=tokens)
    h = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + 1))
    mlp = moe_quant.layer_mlp(layer, top_k, renormalize, scoring, "silu")
    ids, weights = _route(mlp, h, top_k)
    want_weights, want_ids = reference.moe_route(_logits(layer, h), top_k, renormalize, scoring)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want_weights.double(), rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_nan_rows_sort_as_torchs():
    layer = _layer(8, 32, 32, "int4")
    layer.router[5] = layer.router[1] = layer.router[6] = 0.5  # three equal, largest logits
    h = torch.ones(2, 32)
    h[1, 3] = float("nan")  # every logit NaN
    mlp = moe_quant.layer_mlp(layer, 3, True, "softmax", "silu")
    ids, weights = _route(mlp, h, 3)
    want_weights, want_ids = reference.moe_route(_logits(layer, h).float(), 3, True, "softmax")
    assert ids[0].tolist() == [1, 5, 6] and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, equal_nan=True)


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, fmt, shared, bias", CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_mlp_matches_the_float_reference(tokens, experts, top_k, hidden, inter, fmt, shared,
                                             bias, activation):  # fmt: skip
    layer = _layer(experts, hidden, inter, fmt, shared, bias, seed=2 * tokens)
    h = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    for renormalize, scoring in ROUTINGS:
        mlp = moe_quant.layer_mlp(layer, top_k, renormalize, scoring, activation)
        got = _run(mlp, h)
        want = _reference(layer, h, top_k, renormalize, scoring, activation)
        assert not got.isnan().any()
        # the GEMV's 16-bit activations: ~2e-5 a GEMM
        assert relative_error(got, want.float()) < 1e-4, (renormalize, scoring)


@pytest.mark.parametrize("experts", [16, 7])  # (7: the router GEMM's odd expert and rows)
def test_a_rows_bits_depend_on_its_own_inputs_only(experts):
    layer = _layer(experts, 64, 32, "int4", shared=64, router_bias=True, seed=4)
    h = torch.randn(25, 64, generator=torch.Generator().manual_seed(4))
    mlp = moe_quant.layer_mlp(layer, 4, True, "softmax", "silu")
    many = _run(mlp, h, threads=2, min_macs=1)  # every part split over both threads
    for threads, path in ((1, None), (2, None), (1, "portable")):
        for t in (0, 9, 24):
            assert torch.equal(_run(mlp, h[t : t + 1], threads=threads, path=path)[0], many[t])
    assert torch.equal(_run(mlp, h, threads=1), many)


def test_bad_shapes_are_refused_before_writing():
    layer = _layer(4, 32, 32, "int8", shared=32)
    module = quant_gemv.cpu_module()
    experts = moe_quant._expert_tuples(layer.experts_gate_up, None)
    down = moe_quant._expert_tuples(layer.experts_down, None)
    common = dict(gate_up=experts, down=down, hidden_size=32, intermediate=32, activation=0)
    router = layer.router.data_ptr()
    with pytest.raises(ValueError, match="a router of 4 experts choosing 5"):
        module.MoeMlp(**common, router=router, top_k=5)
    with pytest.raises(ValueError, match="do not chain with hidden 48"):
        module.MoeMlp(**common | dict(hidden_size=48), router=router, top_k=2)
    shared_down = moe_quant.module_args.linear_tuple(layer.gate_up, None)  # [64, 32]: not [32, *]
    with pytest.raises(ValueError, match="the shared expert's gate_up"):
        module.MoeMlp(
            **common, router=router, top_k=2, shared_down=shared_down,
            shared_gate_up=moe_quant.module_args.linear_tuple(layer.gate_up, None),
            shared_gate=layer.shared_gate.data_ptr(),
        )  # fmt: skip


@pytest.mark.parametrize(
    "case", ["clamped swiglu", "bf16 router", "quantized shared gate", "router shape",
             "host-loop variant", "unknown scoring"],
)  # fmt: skip
def test_what_it_does_not_compute_is_left_to_the_ops(case, kernels):
    layer = _layer(4, 32, 32, "int4", shared=32)
    activation, scoring = "silu", "softmax"
    assert moe_quant.layer_mlp(layer, 2, True, scoring, activation) is not None  # (as given)
    if case == "clamped swiglu":
        activation = "clamped_swiglu"
    elif case == "bf16 router":
        layer.router = layer.router.bfloat16()
    elif case == "quantized shared gate":
        layer.shared_gate = quantize(torch.randn(1, 32), "int8", 32)
    elif case == "router shape":
        layer.router = layer.router[:, :16]
    elif case == "host-loop variant":
        kernels(cpu_moe="loop")
    elif case == "unknown scoring":
        scoring = "argmax"
    assert moe_quant.layer_mlp(layer, 2, True, scoring, activation) is None
