"""GGUF files of llama.cpp's 3-bit K-quant and IQ4 codebooks (Q3_K_S- and IQ4_XS-shaped):
each Q3_K / IQ4_XS / IQ4_NL matrix loads as int8 codes with its own scale per 16 / 32, the
file's values exactly, in the mode that keeps every layer as the file has it (they loaded as
fp32 before, or requantized to int4 beside 4-bit blocks); the logits are the file's dense
model's within the 16-bit activations' rounding."""

from __future__ import annotations

import gguf
import pytest
import torch
from test_model_gguf import TEXT, all_logits, base_config, dense_logits, write_gguf

from pagedkern.model import load_model
from pagedkern.model.gguf_loader import gguf_default_quantization
from pagedkern.model.quantized_linear import QuantizedWeight

T = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "shape,mode",
    [
        ({"attn_q": T.IQ4_XS, "attn_k": T.IQ4_XS, "attn_v": T.Q6_K, "attn_output": T.IQ4_XS,
          "ffn_gate": T.IQ4_NL, "ffn_up": T.IQ4_NL, "ffn_down": T.Q6_K}, "int8"),  # IQ4_XS-like
        ({"attn_q": T.Q3_K, "attn_k": T.Q3_K, "attn_v": T.Q3_K, "attn_output": T.Q4_0,
          "ffn_gate": T.Q3_K, "ffn_up": T.Q3_K, "ffn_down": T.Q5_K}, "int4"),  # Q3_K_S-like
    ],
    ids=["iq4_xs", "q3_k_s"]
)  # fmt: skip
def test_codebook_files_keep_each_tensors_values(tmp_path, shape, mode):
    cfg = base_config(hidden_size=256, intermediate_size=512)
    types = {"output.weight": T.Q6_K}
    for layer in range(cfg["num_hidden_layers"]):
        types |= {f"blk.{layer}.{part}.weight": kind for part, kind in shape.items()}
    expected = write_gguf(tmp_path / "m.gguf", cfg, "llama", types=types)
    assert gguf_default_quantization(tmp_path / "m.gguf") == mode
    model, tok = load_model(tmp_path / "m.gguf", use_cache=False)
    groups = {T.Q3_K: 16, T.IQ4_XS: 32, T.IQ4_NL: 32}
    for i, layer in enumerate(model.weights.layers):
        p = f"model.layers.{i}."
        _exact(layer.o, [expected[p + "self_attn.o_proj.weight"]], groups.get(shape["attn_output"]))
        if shape["attn_output"] == T.Q4_0:  # (4-bit blocks beside them stay int4)
            assert layer.o.format == "int4"
        gate_up = [expected[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
        _exact(layer.gate_up, gate_up, groups.get(shape["ffn_gate"]))
    ids = tok.encode(TEXT)
    got, want = all_logits(model, ids), dense_logits(expected, cfg, ids)
    assert 0 < (got - want).abs().max().item() < 2e-3 * want.abs().max().item()


def _exact(weight, parts: list[torch.Tensor], group: int | None) -> None:
    """weight holds `parts` (fused) exactly; as int8 with a scale per `group` where given."""
    assert isinstance(weight, QuantizedWeight)
    if group is not None:
        assert (weight.format, weight.group_size, weight.mins) == ("int8", group, None)
    assert torch.equal(weight.dequantize_rows(), torch.cat(parts).float())
