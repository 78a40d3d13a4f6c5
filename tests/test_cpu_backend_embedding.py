"""The CPU backend's embedding lookup from a quantized table (ops/cpu/embedding.py,
csrc/cpu/dequantize_rows.cpp) against QuantizedWeight.dequantize_rows: the same bits for every
format (int4 with fp16 or fp32 scales, int8 per row, per group of 16 or 32, with mins), over
odd row counts, repeated ids and enough rows to run on threads; ids outside the table refused
before a row is written; weights it does not take run the reference; a tied model's steps take
it."""

from __future__ import annotations

import pytest
import torch

from pagedkern import ops
from pagedkern.model import PRESETS, SequenceChunk, build_batch, load_model
from pagedkern.model.quantized_linear import quantize_int4, quantize_int8, quantize_int8_grouped
from pagedkern.ops.cpu import embedding, quant_gemv
from pagedkern.reference.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")


def _weight(kind: str, n: int, k: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)
    if kind == "int4 fp16 scales":
        return quantize_int4(w, 32)
    if kind == "int4 fp32 scales":  # (GGUF Q4_K's: fp16 cannot hold them)
        qw = quantize_int4(w, 128)
        return QuantizedWeight("int4", (n, k), qw.qweight, qw.scales.float() * 1.0001,
                               qw.mins.float(), 128)  # fmt: skip
    if kind == "int8 per row":
        return quantize_int8(w)
    if kind == "int8 with mins":  # (GGUF Q5's form: q in 0..31)
        q = torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, k // 32, generator=g) * 1e-2
        return QuantizedWeight("int8", (n, k), q, scales, -scales * 16.5, 32)
    return quantize_int8_grouped(w, int(kind.split()[-1]))


KINDS = ["int4 fp16 scales", "int4 fp32 scales", "int8 per row", "int8 group 16",
         "int8 group 32", "int8 with mins"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_rows_are_the_references_bits(kind, rows):
    weight = _weight(kind, 509, 256, seed=rows)
    ids = torch.randint(0, 509, (rows,), generator=torch.Generator().manual_seed(rows))
    ids[0] = 508  # the last row, and a repeated id
    if rows > 1:
        ids[-1] = ids[0]
    got = embedding.dequantize_rows(weight, ids.int(), torch.float32)
    want = weight.dequantize_rows(ids, torch.float32)
    assert weight.packed["cpu-dequantize-rows"] is not None  # (the C++ rows ran)
    assert not got.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [-1, 509, 2**31 - 1])
def test_ids_outside_the_table_are_refused(bad):
    weight = _weight("int8 group 32", 509, 64, seed=1)
    with pytest.raises(IndexError, match=rf"ids\[2\] = {bad} is outside the weight's 509 rows"):
        embedding.dequantize_rows(
            weight, torch.tensor([0, 3, bad], dtype=torch.int32), torch.float32
        )


def test_what_it_does_not_take_runs_the_reference():
    weight = _weight("int4 fp16 scales", 64, 64, seed=2)
    bf16 = QuantizedWeight("int4", (64, 64), weight.qweight, weight.scales.bfloat16(),
                           weight.mins.bfloat16(), 32)  # fmt: skip
    ids = torch.tensor([5, 63, 0])
    for w, dtype in [(bf16, torch.float32), (weight, torch.bfloat16)]:
        got = embedding.dequantize_rows(w, ids, dtype)
        assert got.dtype == dtype and torch.equal(got, w.dequantize_rows(ids, dtype))
    assert bf16.packed["cpu-dequantize-rows"] is None


def test_a_tied_models_steps_take_it(monkeypatch):
    """A step on the CPU backend gives the same hidden states with the reference's rows."""
    model, _ = load_model(PRESETS["tiny"].replace(tie_word_embeddings=True), quantization="int8")
    assert isinstance(model.weights.embed, QuantizedWeight)
    step = [SequenceChunk(list(range(3, 40)), 0, [1, 2, 3])]
    calls, hidden = [], []
    for rows in (embedding.dequantize_rows, lambda w, ids, dtype: w.dequantize_rows(ids, dtype)):
        monkeypatch.setattr(
            embedding, "dequantize_rows", lambda *a, f=rows: calls.append(a) or f(*a)
        )
        kv = model.allocate_kv_cache(8, 16)
        with ops.use_backend("cpu"):
            hidden.append(model.hidden_states(*build_batch(step, 16), kv))
    assert [a[1].shape for a in calls] == [(37,), (37,)]
    assert model.weights.embed.packed["cpu-dequantize-rows"] is not None
    assert not hidden[0].isnan().any()
    assert torch.equal(hidden[0], hidden[1])


def test_ids_wider_than_int32_run_the_reference():
    """An int64 id past int32 is refused as the reference refuses it, not wrapped onto a row."""
    weight = _weight("int8 group 32", 509, 64, seed=3)
    with pytest.raises(IndexError):
        embedding.dequantize_rows(weight, torch.tensor([2**32 + 5]), torch.float32)


@pytest.mark.parametrize(
    "bad, id_dtype, dtype, bf16_scales",
    [
        (-1, torch.int64, torch.float32, False),
        (509, torch.int64, torch.float32, False),
        (-(2**32), torch.int64, torch.float32, False),
        (-1, torch.int32, torch.bfloat16, False),
        (-1, torch.int32, torch.float32, True),
    ],
)
def test_ids_outside_the_table_are_refused_off_the_cpp_rows_too(bad, id_dtype, dtype, bf16_scales):
    """The reference's rows (ids, dtypes and weights the C++ does not take) refuse what the C++
    refuses, with its message: indexing would wrap -1 onto the last row."""
    weight = _weight("int8 group 32", 509, 64, seed=4)
    if bf16_scales:
        weight = QuantizedWeight("int8", (509, 64), weight.qweight, weight.scales.bfloat16(),
                                 None, 32)  # fmt: skip
    ids = torch.tensor([0, 3, bad], dtype=id_dtype)
    with pytest.raises(IndexError, match=rf"ids\[2\] = {bad} is outside the weight's 509 rows"):
        embedding.dequantize_rows(weight, ids, dtype)
    if bf16_scales:
        assert weight.packed["cpu-dequantize-rows"] is None  # (the reference's rows)
