"""Runtime weights of a Llama-family model, fused for the forward: a LayerWeights per layer
and the LlamaWeights around them (moved to a device and dtype, or flattened to the weights
cache's state dict). How a checkpoint's tensors become them is weight_assembly.py's, under the
HF names of checkpoint_layout.py; their quantized forms are weight_quantization.py's."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .config import ModelConfig
from .quantized_linear import QuantizedWeight

# A linear layer's weight: a float tensor or a weight-only quantized one.
Linear = torch.Tensor | QuantizedWeight
LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")
# A 16-bit checkpoint's weight dtypes (kept under the CPU's fp32 activations: keep_16_bit)
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [Hq*D + 2*Hkv*D, H]: q rows, k rows, v rows; rotate-half RoPE layout
    o: Linear  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear | None  # [2I, H]: gate rows then up rows, the halves silu_and_mul expects
    down: Linear | None  # [H, I]; both None in a MoE layer without a shared expert
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D]: QK-norm (Qwen3), per query head before RoPE
    k_norm: torch.Tensor | None = None  # [D]: per key head
    # Sandwich norms (Gemma): the attention output normed before its residual add (HF's
    # post_attention_layernorm there; post_norm is then its pre_feedforward_layernorm) and the
    # MLP output likewise (post_feedforward_layernorm).
    attn_out_norm: torch.Tensor | None = None  # [H]
    mlp_out_norm: torch.Tensor | None = None  # [H]
    # A mixture-of-experts layer (config.is_moe_layer): the router and every expert's weights
    # stacked at load, as ops.fused_moe takes them. gate_up / down then hold the shared expert
    # (Qwen2-MoE), whose output is scaled by sigmoid(shared_gate . x).
    router: torch.Tensor | None = None  # [E, H]
    # (float, or stacked QuantizedWeights [E, N, K] when the layers are quantized)
    experts_gate_up: Linear | None = None  # [E, 2I, H]: each expert's gate rows, up rows
    experts_down: Linear | None = None  # [E, H, I]
    shared_gate: torch.Tensor | None = None  # [1, H]
    # gpt-oss (model/gpt_oss.py): per-head sink logits (float32), the router's and the experts'
    # biases (gate_up's in experts_gate_up's row order)
    sinks: torch.Tensor | None = None  # [Hq] float32
    router_bias: torch.Tensor | None = None  # [E]
    experts_gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    experts_down_bias: torch.Tensor | None = None  # [E, H]


@dataclass(slots=True)
class LlamaWeights:
    embed: Linear  # [V, H]; quantized only when tied to a quantized LM head (rows dequantized)
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: Linear  # [V, H]; the embed tensor itself when embeddings are tied
    rope_freq_factors: torch.Tensor | None = None  # [D/2] fp32, divides the RoPE frequencies

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    def to(
        self, device: torch.device | str, dtype: torch.dtype, keep_16_bit: bool = False
    ) -> LlamaWeights:
        """A copy on `device` in `dtype` (tensors already there are shared, ties kept).
        keep_16_bit: bf16 / fp16 linear weights, embedding and LM head keep their dtype (the
        16-bit checkpoints' weights under the CPU's fp32 activations: assemble_weights)."""

        def move(t: Linear | None, dtype: torch.dtype = dtype, linear: bool = False):
            if isinstance(t, QuantizedWeight):
                return t.to(device)
            if t is None:
                return None
            if linear and keep_16_bit and t.dtype in HALF_DTYPES:
                return t.to(device=device)
            return t.to(device=device, dtype=dtype)

        def field_dtype(name: str) -> torch.dtype:
            return torch.float32 if name == "sinks" else dtype  # (the kernels read fp32 sinks)

        layers = [
            LayerWeights(
                **{
                    f.name: move(
                        getattr(layer, f.name), field_dtype(f.name), f.name in LINEAR_FIELDS
                    )
                    for f in fields(LayerWeights)
                }
            )
            for layer in self.layers
        ]
        embed = move(self.embed, linear=True)
        factors = self.rope_freq_factors
        return LlamaWeights(
            embed,
            layers,
            move(self.norm),
            embed if self.tied else move(self.lm_head, linear=True),
            None if factors is None else factors.to(device=device, dtype=torch.float32),
        )

    @property
    def quantization(self) -> str:
        """'int8' / 'int4' (the format of the first layer's quantized MLP weights, the most of
        its bytes, else of its QKV: a GGUF's fused projection of two forms may differ) or
        'none'."""
        layer = self.layers[0] if self.layers else None
        candidates = () if layer is None else (layer.gate_up, layer.experts_gate_up, layer.qkv)
        w = next((w for w in candidates if isinstance(w, QuantizedWeight)), None)
        return "none" if w is None else w.format

    @property
    def nbytes(self) -> int:
        """Bytes of every weight in memory (a tied head counted once)."""
        seen: dict[int, int] = {}
        for t in self.state_dict().values():
            seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map (the weights cache format); a tied lm_head is left out, a
        quantized weight is stored as its parts (<name>.qweight, .scales, .mins, .qmeta and an
        act-order weight's .input_index)."""
        out: dict[str, torch.Tensor] = {}

        def put(name: str, t: Linear | None) -> None:
            if isinstance(t, QuantizedWeight):
                out.update(t.state_dict(name))
            elif t is not None:
                out[name] = t

        put("embed", self.embed)
        put("norm", self.norm)
        if not self.tied:
            put("lm_head", self.lm_head)
        put("rope_freq_factors", self.rope_freq_factors)
        for i, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                put(f"layers.{i}.{f.name}", getattr(layer, f.name))
        return out

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: dict[str, torch.Tensor]) -> LlamaWeights:
        def get(name: str) -> Linear | None:
            return QuantizedWeight.from_state_dict(name, sd) or sd.get(name)

        layers = [
            LayerWeights(**{f.name: get(f"layers.{i}.{f.name}") for f in fields(LayerWeights)})
            for i in range(config.num_layers)
        ]
        embed = get("embed")
        lm_head = embed if config.tie_word_embeddings else get("lm_head")
        return cls(embed, layers, sd["norm"], lm_head, sd.get("rope_freq_factors"))
