"""Where a quantized model's GEMMs run: quant_gemm.cu only where it measured faster than a bf16
GEMM (model/quantized_linear.py quant_gemm_wins, from the first GPU run's numbers); on CUDA a
quantized model's linear weights are dequantized at load (model/loading.py gemm_weights),
because the engine also runs every linear at M > 1, where bf16 won at every measured shape."""

from __future__ import annotations

import torch

from pagedkern.model import load_model
from pagedkern.model.loading import gemm_weights, keeps_quantized_weights
from pagedkern.model.quantized_linear import (
    QUANT_GEMM_MEASURED,
    QuantizedWeight,
    quant_gemm_wins,
)
from pagedkern.model.weights import LINEAR_FIELDS


def test_the_rule_follows_every_measured_shape():
    cases = 0
    for (n, k), rows in QUANT_GEMM_MEASURED.items():
        for m, (quantized, bf16) in rows.items():
            assert quant_gemm_wins(m, n, k) == (quantized < bf16), (m, n, k)
            cases += 1
    assert cases == 12
    assert quant_gemm_wins(1, 4096, 4096) and not quant_gemm_wins(4, 4096, 4096)
    assert not quant_gemm_wins(1, 14336, 4096) and not quant_gemm_wins(64, 576, 576)


def test_cuda_keeps_no_quantized_weights_the_cpu_does():
    assert keeps_quantized_weights(torch.device("cpu"))
    assert not keeps_quantized_weights(torch.device("cuda"))


def test_gemm_weights_on_cuda_are_the_quantized_values_in_the_model_dtype():
    """The CUDA decision applied to CPU tensors (the device only decides): every quantized
    linear weight, the int8 head and the tied embedding become bf16 tensors holding exactly
    the dequantized values; norms are untouched; on the CPU the weights stay as they are."""
    model, _ = load_model("synthetic:tiny", "cpu", torch.float32, quantization="int4")
    weights = model.weights
    assert weights.quantization == "int4"
    assert gemm_weights(weights, torch.device("cpu"), torch.bfloat16) is weights
    plain = gemm_weights(weights, torch.device("cuda"), torch.bfloat16)
    assert plain.quantization == "none"
    for before, after in zip(weights.layers, plain.layers, strict=True):
        for name in LINEAR_FIELDS:
            q, w = getattr(before, name), getattr(after, name)
            assert isinstance(q, QuantizedWeight) and isinstance(w, torch.Tensor)
            assert w.dtype == torch.bfloat16 and tuple(w.shape) == q.shape
            assert torch.equal(w, q.dequantize_rows(dtype=torch.bfloat16)), name
        assert after.input_norm is before.input_norm
    head = weights.lm_head
    assert isinstance(head, QuantizedWeight) and head.format == "int8"
    assert torch.equal(plain.lm_head, head.dequantize_rows(dtype=torch.bfloat16))
    assert plain.tied == weights.tied
    if plain.tied:
        assert plain.embed is plain.lm_head
    assert plain.nbytes > weights.nbytes  # the memory a GPU does not save
