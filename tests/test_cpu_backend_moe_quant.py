"""The CPU backend's quantized experts in one C++ call (ops/cpu/moe_quant.py,
csrc/cpu/moe_experts.cpp) against the float reference over the dequantized experts and against
the host loop it replaces (cpu_moe:loop): int4 (G 32 / 128) and int8, odd token counts, top-k
from 1 to E, idle experts and one expert taking every token, SiLU and GELU-tanh, expert biases;
a token's bits independent of the batch and the thread count; ids outside the experts refused;
what it does not take runs the loop; and a quantized Qwen3-MoE-shaped model through it (and
through the layer tail's MoE MLP, csrc/cpu/moe_mlp.cpp, which its steps take by default)."""

from __future__ import annotations

import pytest
import torch
from kernel_check import relative_error
from moe_quant_check import quantized_operands

from pagedkern import ops, reference
from pagedkern.model import PRESETS, SequenceChunk, build_batch, load_model
from pagedkern.ops.cpu import moe_quant, quant_gemv
from pagedkern.reference.quant_gemm import dequantize

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The tokens of each C++ call."""
    seen: list[int] = []
    real = moe_quant.fused_moe_quantized
    monkeypatch.setattr(
        moe_quant, "fused_moe_quantized", lambda h, *a: seen.append(h.shape[0]) or real(h, *a)
    )
    return seen


def _float_experts(w) -> torch.Tensor:
    """[E, N, K] fp32: the experts as the GEMV multiplies them (float64 dequantized, exact)."""
    return torch.stack([dequantize(w.expert(e)) for e in range(w.shape[0])]).float()


CASES = [  # tokens, experts, top_k, hidden, inter, format, group
    (1, 8, 2, 64, 32, "int4", 32),
    (3, 6, 3, 96, 64, "int4", 32),
    (17, 5, 1, 128, 128, "int4", 128),
    (5, 7, 7, 32, 96, "int8", 0),
    (33, 16, 4, 64, 64, "int8", 0),
]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, fmt, group", CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_matches_the_float_reference(tokens, experts, top_k, hidden, inter, fmt, group,
                                     activation, calls):  # fmt: skip
    x, logits, gu, down = quantized_operands(
        tokens, experts, hidden, inter, torch.float32, fmt, group or 32, seed=tokens + experts
    )
    with ops.use_backend("cpu"):
        got = ops.fused_moe(x, logits, gu, down, top_k, activation=activation)
    assert calls == [tokens]
    want = reference.fused_moe(
        x.double(), logits, _float_experts(gu).double(), _float_experts(down).double(), top_k,
        activation=activation,
    )  # fmt: skip
    assert got.dtype == torch.float32 and not got.isnan().any()
    # the GEMV's 16-bit activations: ~2e-5 a GEMM
    assert relative_error(got, want.float()) < 1e-4


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_close_to_the_host_loop_with_biases_and_idle_experts(fmt, calls, kernels):
    x, logits, gu, down = quantized_operands(9, 8, 64, 32, torch.float32, fmt, 32, seed=4)
    logits[:, :] = -4.0
    logits[:, 6], logits[:, 2] = 4.0, 3.0  # every token to experts 6 and 2, the rest idle
    g = torch.Generator().manual_seed(5)
    biases = dict(
        w_gate_up_bias=torch.randn(8, 64, generator=g), w_down_bias=torch.randn(8, 64, generator=g)
    )
    options = dict(renormalize=False, scoring="sigmoid", **biases)
    with ops.use_backend("cpu"):
        got = ops.fused_moe(x, logits, gu, down, 2, **options)
        assert calls == [9]
        kernels(cpu_moe="loop")
        want = ops.fused_moe(x, logits, gu, down, 2, **options)
    assert calls == [9]  # the loop made no call
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tokens_bits_depend_on_its_own_routing_only():
    x, logits, gu, down = quantized_operands(12, 8, 64, 32, torch.float32, "int4", 32, seed=6)
    torch.set_num_threads(2)  # (restored below)
    try:
        with ops.use_backend("cpu"):
            many = ops.fused_moe(x, logits, gu, down, 3)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in (0, 7, 11):
                    one = ops.fused_moe(x[t : t + 1], logits[t : t + 1], gu, down, 3)
                    assert torch.equal(one[0], many[t])
    finally:
        torch.set_num_threads(1)


def test_ids_outside_the_experts_are_refused():
    x, logits, gu, down = quantized_operands(2, 4, 32, 32, torch.float32, "int8", 32, seed=7)
    experts = moe_quant._experts(gu, down, (None, None), "silu")
    ids = torch.tensor([[0, 4], [1, 2]], dtype=torch.int32)
    weights = torch.ones(2, 2)
    out = torch.full((2, 32), float("nan"))
    module = quant_gemv.cpu_module()
    with pytest.raises(ValueError, match=r"ids\[1\] = 4 is outside the 4 experts"):
        experts.run_routed(x.data_ptr(), 2, 2, ids.data_ptr(), weights.data_ptr(),
                           out.data_ptr(), 1, 1 << 16, module.PATHS["portable"], 16)  # fmt: skip
    assert out.isnan().all()  # nothing written


@pytest.mark.parametrize("case", ["loop variant", "int_pack", "bf16 hidden", "clamped swiglu"])
def test_what_it_does_not_take_runs_the_loop(case, calls, kernels):
    dtype = torch.bfloat16 if case == "bf16 hidden" else torch.float32
    x, logits, gu, down = quantized_operands(3, 4, 32, 32, dtype, "int4", 32, seed=8)
    options = {}
    if case == "loop variant":
        kernels(cpu_moe="loop")
    elif case == "int_pack":
        kernels(cpu_quant_linear="int_pack")
    elif case == "clamped swiglu":
        options = dict(activation="clamped_swiglu")
    with ops.use_backend("cpu"):
        out = ops.fused_moe(x, logits, gu, down, 2, **options)
    assert calls == [] and not out.isnan().any()


@pytest.mark.parametrize("shared", [0, 64], ids=["routed", "shared expert"])
def test_a_quantized_moe_models_steps_take_it(shared, calls, kernels):
    """By default a MoE layer's MLP runs in the layer tail's call (router and top-k in C++:
    csrc/cpu/moe_mlp.cpp); without the tail, model/moe.py's ops with one experts call a layer;
    both close to the host loop."""
    config = PRESETS["tiny"].replace(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        shared_expert_size=shared,
    )  # fmt: skip
    model, _ = load_model(config, quantization="int4", seed=2)
    chunks = [SequenceChunk(list(range(3, 23)), 0, [1, 2])]
    got, made = {}, {}
    runs = {"tail": {}, "ops": dict(cpu_layer_tail="ops"), "loop": dict(cpu_moe="loop")}
    for name, chosen in runs.items():
        kernels(cpu_decoder="layers", **chosen)
        kv = model.allocate_kv_cache(4, 16)
        with ops.use_backend("cpu"):
            got[name] = model.hidden_states(*build_batch(chunks, 16), kv)
        made[name] = len(calls)
        kernels(cpu_layer_tail="fused", cpu_moe="fused")
    assert made == {"tail": 0, "ops": config.num_layers, "loop": config.num_layers}
    assert calls == [20] * config.num_layers  # the ops' one call a layer, every row
    assert not got["tail"].isnan().any()
    # the tail's norms round h apart from torch's (~1e-7), and the quantized GEMMs' 16-bit
    # activations can turn that into a quantum (~3e-5 of a block's max) at each of 2 x 4 GEMMs
    torch.testing.assert_close(got["tail"], got["loop"], rtol=5e-4, atol=5e-4)
    torch.testing.assert_close(got["ops"], got["loop"], rtol=1e-4, atol=1e-4)
