"""The CPU backend's decoder: a step's whole stack of plain Llama-family layers in one C++ call
(csrc/cpu/decoder.h): per layer the QKV GEMV, RoPE + the k/v store, attention, the layer tail.

Each piece is the function the layer loop calls one by one (quant_gemv, rope_cache, the
attention kernel, layer_tail), in the same order on the same buffers, so the call gives the
loop's bits; it removes the Python between them (at batch 1 on SmolLM2-135M, ~40% of a
token's time on a 2-vCPU host). A model runs it where every layer has the shape it computes:
int4/int8 QKV (a fused QKV weight), the fused layer tail's shape (layer_tail.runs), no window,
soft-cap, sinks or QK-norm, an fp32 cache of one table without fp8 scales, the attention kernel
selected (cpu_attention:kernel) and C++-built. Whether it runs is fixed per model, cache and
variants, never per batch. `PAGEDKERN_KERNELS=cpu_decoder:layers` runs the layer loop instead.
"""

from __future__ import annotations

import torch

from .. import variants
from . import attention_kernel, layer_tail, quant_gemv, rope


def _plain(config, layers) -> bool:
    """Whether every layer is one the C++ decoder computes (model-level options)."""
    return (
        config.attn_soft_cap is None
        and not config.qk_norm_whole
        and all(config.layer_window(i) is None for i in range(len(layers)))
        and all(layer.q_norm is None and layer.sinks is None for layer in layers)
    )


class CpuDecoder:
    """One model's decoder over one set of weights and KV cache at a time (built on first use,
    rebuilt for others). `for_step(...)` -> a callable run(h, residual, meta) for this step, or
    None where the model, its cache or the variants rule it out (the caller runs the loop)."""

    def __init__(self, config):
        self.config = config
        self._built: tuple | None = None  # (key, the module's Decoder or None, what it reads)

    def for_step(
        self, tail: layer_tail.LayerTail, weights, cos_sin: torch.Tensor, kv_cache
    ) -> object | None:
        """tail: the model's fused tail as this step's for_step() returned it (not None)."""
        if variants.selected("cpu_decoder") != "fused":
            return None
        if not attention_kernel.applies(kv_cache.layers[0][0], self.config.head_dim):
            return None
        data = kv_cache.data
        key = (data.data_ptr(), tuple(data.shape), data.dtype, id(kv_cache), id(weights))
        key += (id(cos_sin), cos_sin._version)
        if self._built is None or self._built[0] != key:
            self._built = None  # (the old decoder's addresses are dropped first)
            self._built = (key, *self._build(tail, weights, cos_sin, kv_cache))
        decoder = self._built[1]
        if decoder is None:
            return None
        settings = tail.settings
        return lambda h, residual, meta: _run(decoder, settings, h, residual, meta)

    def _build(self, tail: layer_tail.LayerTail, weights, cos_sin, kv_cache) -> tuple:
        """(the module's Decoder or None, the objects whose addresses it holds)."""
        c, w = self.config, weights
        layers = w.layers
        k0 = kv_cache.layers[0][0]
        fits = (
            _plain(c, layers)
            and kv_cache.scales is None
            and kv_cache.groups is None
            and k0.dtype == torch.float32
            and k0.stride(3) == 1
            and c.head_dim % 8 == 0
            and c.head_dim <= 512
            and cos_sin.dtype == torch.float32
            and all(k.stride() == v.stride() == k0.stride() for k, v in kv_cache.layers)
        )
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        qkv_fits = (
            layer_tail.quantized_fits(layer.qkv, layer.qkv_bias, qkv_rows, c.hidden_size)
            for layer in layers
        )
        if not fits or not all(qkv_fits):
            return None, ()
        tuples = []
        for i, (layer, (k, v)) in enumerate(zip(layers, kv_cache.layers, strict=True)):
            fused = tail.weights_of(layer)
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else w.norm
            vectors = (layer.post_norm, next_norm)
            if fused is None or not all(layer_tail.fp32_vector(x, c.hidden_size) for x in vectors):
                return None, ()
            qkv = layer_tail.linear_tuple(layer.qkv, layer.qkv_bias)
            tuples.append(
                (qkv, *fused, *(x.data_ptr() for x in vectors), k.data_ptr(), v.data_ptr())
            )
        factors = rope.factors_table(cos_sin)
        scale = attention_kernel.score_scale(c.head_dim, c.attn_scale, None)
        decoder = quant_gemv.cpu_module().Decoder(
            layers=tuples, hq=c.num_heads, hkv=c.num_kv_heads, d=c.head_dim,
            hidden=c.hidden_size, intermediate=c.intermediate_size, eps=c.rms_norm_eps,
            scale=scale, block_stride=k0.stride(0), head_stride=k0.stride(1),
            slot_stride=k0.stride(2), num_blocks=k0.shape[0], block_size=k0.shape[2],
            factors=factors.data_ptr(), num_positions=factors.shape[0],
            parallel_min_macs=quant_gemv.PARALLEL_MIN_MACS,
        )  # fmt: skip
        return decoder, (weights, factors, kv_cache)  # (kept alive while it reads them)


def _run(decoder, settings: dict, h: torch.Tensor, residual: torch.Tensor, meta) -> None:
    """The step through the decoder: h [T, H] (the first layer's normed input; the final
    normed output) and residual [T, H] in place, fp32 contiguous."""
    m = h.shape[0]
    if not (
        h.is_contiguous()
        and residual.is_contiguous()
        and h.dtype == residual.dtype == torch.float32
    ):
        raise ValueError("the decoder's h and residual must be contiguous float32")
    positions = meta.positions.long().contiguous()
    slots = meta.slot_mapping.long().contiguous()
    row_seq, row_pos = attention_kernel.chunk_rows(meta.cu_seqlens, meta.seq_lens, m)
    tables = attention_kernel.as_int32(meta.block_tables)
    decoder.run(
        m, h.data_ptr(), residual.data_ptr(), positions.data_ptr(), slots.data_ptr(),
        row_seq.data_ptr(), row_pos.data_ptr(), tables.data_ptr(), tables.stride(0),
        tables.shape[0], tables.shape[1], settings["threads"], settings["path"],
        settings["activation_bits"],
    )  # fmt: skip
