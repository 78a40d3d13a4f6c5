"""The CPU backend's decoder: a step's whole stack of Llama-family layers (dense or
mixture-of-experts) in one C++ call (csrc/cpu/decoder.h): per layer the QKV GEMV, QK-norm,
RoPE + the k/v store, attention, the layer tail.

Each piece is the function the layer loop calls one by one (quant_gemv, rope_cache, the
attention kernel, layer_tail), in the same order on the same buffers, so the call gives the
loop's bits; it removes the Python between them (at batch 1 on SmolLM2-135M, ~40% of a
token's time on a 2-vCPU host). A model runs it where every layer has a shape it computes:
int4/int8 QKV (a fused QKV weight), the fused layer tail's shape (layer_tail.runs: SiLU or
GeGLU, sandwich norms or none; a MoE layer's MLP where moe_quant.layer_mlp takes it),
per-head QK-norm or none, any sliding windows, attention sinks and soft-cap, an fp32, bf16,
fp16 or fp8 (E4M3, per-layer scales) cache (a hybrid cache's layer groups read their own
tables), the attention kernel selected (cpu_attention:kernel) and C++-built: Llama, Mistral,
Qwen2/3, Qwen2/3-MoE, Mixtral, OLMoE-shaped MoE without its whole-projection QK-norm, and
Gemma 2/3.
Whether it runs is fixed per model, cache and variants, never per batch.
`PAGEDKERN_KERNELS=cpu_decoder:layers` runs the layer loop instead.
"""

from __future__ import annotations

import torch

from .. import variants
from . import attention_kernel, layer_tail, module_args, quant_gemv, rope


def _plain(config, layers) -> bool:
    """Whether every layer's attention is one the C++ decoder computes: per-head QK-norm or
    none (not OLMoE's whole-projection norm), norms and sinks fp32."""
    fp32 = module_args.fp32_vector
    return not config.qk_norm_whole and all(
        fp32(layer.q_norm, config.head_dim)
        and fp32(layer.k_norm, config.head_dim)
        and fp32(layer.sinks, config.num_heads)
        and (layer.q_norm is None) == (layer.k_norm is None)
        for layer in layers
    )


class CpuDecoder:
    """One model's decoder over one set of weights and KV cache at a time (built on first use,
    rebuilt for others). `for_step(...)` -> a callable run(h, residual, metas) for this step
    (metas: the step's metadata per KV layer group, group 0's first), or None where the model,
    its cache or the variants rule it out (the caller runs the loop)."""

    def __init__(self, config):
        self.config = config
        self._built: tuple | None = None  # (key, the module's Decoder or None, what it reads)

    def for_step(
        self, tail: layer_tail.LayerTail, weights, cos_sin: torch.Tensor,
        cos_sin_local: torch.Tensor, kv_cache,
    ) -> object | None:  # fmt: skip
        """tail: the model's fused tail as this step's for_step() returned it (not None);
        cos_sin, cos_sin_local: the RoPE tables of full-attention and sliding layers."""
        if variants.selected("cpu_decoder") != "fused":
            return None
        if not attention_kernel.applies(kv_cache.layers[0][0], self.config.head_dim):
            return None
        data = kv_cache.data
        key = (data.data_ptr(), tuple(data.shape), data.dtype, id(kv_cache), id(weights))
        key += (id(cos_sin), cos_sin._version, id(cos_sin_local), cos_sin_local._version)
        key += (tuple(kv_cache.scales or ()), variants.selected("cpu_moe"))  # (MoE layers' MLP)
        if self._built is None or self._built[0] != key:
            self._built = None  # (the old decoder's addresses are dropped first)
            self._built = (key, *self._build(tail, weights, cos_sin, cos_sin_local, kv_cache))
        decoder = self._built[1]
        if decoder is None:
            return None
        settings = tail.settings
        return lambda h, residual, metas: _run(decoder, settings, h, residual, metas)

    def _build(self, tail: layer_tail.LayerTail, weights, cos_sin, cos_sin_local, kv_cache):
        """(the module's Decoder or None, the objects whose addresses it holds)."""
        c, w = self.config, weights
        layers = w.layers
        k0 = kv_cache.layers[0][0]
        fits = (
            _plain(c, layers)
            and k0.dtype in attention_kernel.CACHE_DTYPES
            and k0.stride(3) == 1
            and c.head_dim % 8 == 0
            and c.head_dim <= 512
            and cos_sin.dtype == cos_sin_local.dtype == torch.float32
            and all(k.stride() == v.stride() == k0.stride() for k, v in kv_cache.layers)
        )
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        qkv_fits = (
            module_args.quantized_fits(layer.qkv, layer.qkv_bias, qkv_rows, c.hidden_size)
            for layer in layers
        )
        if not fits or not all(qkv_fits):
            return None, ()
        tables = {id(t): rope.factors_table(t) for t in (cos_sin, cos_sin_local)}
        group_of = kv_cache.groups.layer_group if kv_cache.groups is not None else None
        address = module_args.address
        kv_scales = kv_cache.scales or [(None, None)] * len(layers)
        made = []
        for i, (layer, (k, v)) in enumerate(zip(layers, kv_cache.layers, strict=True)):
            fused = tail.weights_of(layer)
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else w.norm
            vectors = (layer.post_norm, next_norm)
            if fused is None or not all(module_args.fp32_vector(x, c.hidden_size) for x in vectors):
                return None, ()
            window = c.layer_window(i)
            factors = tables[id(cos_sin if window is None else cos_sin_local)]
            k_scale, v_scale = kv_scales[i]  # (an fp8 cache's, as the loop's attention takes them)
            scale = attention_kernel.score_scale(c.head_dim, c.attn_scale, k_scale)
            made.append(dict(
                qkv=module_args.linear_tuple(layer.qkv, layer.qkv_bias), o=fused.o,
                gate_up=fused.gate_up, down=fused.down, moe=fused.moe,
                post_norm=address(layer.post_norm),
                next_norm=address(next_norm), attn_out_norm=address(layer.attn_out_norm),
                mlp_out_norm=address(layer.mlp_out_norm), q_norm=address(layer.q_norm),
                k_norm=address(layer.k_norm), sinks=address(layer.sinks),
                window=window or 0, factors=factors.data_ptr(), num_positions=factors.shape[0],
                group=0 if group_of is None else group_of[i], k_cache=k.data_ptr(),
                v_cache=v.data_ptr(), scale=scale, out_scale=1.0 if v_scale is None else v_scale,
                k_inv_scale=rope.inverse(k_scale), v_inv_scale=rope.inverse(v_scale),
            ))  # fmt: skip
        decoder = quant_gemv.cpu_module().Decoder(
            layers=made, hq=c.num_heads, hkv=c.num_kv_heads, d=c.head_dim,
            hidden=c.hidden_size, intermediate=c.intermediate_size, eps=c.rms_norm_eps,
            soft_cap=c.attn_soft_cap or 0.0, activation=module_args.ACTIVATIONS[c.hidden_act],
            cache_dtype=attention_kernel.CACHE_DTYPES[k0.dtype], block_stride=k0.stride(0),
            head_stride=k0.stride(1), slot_stride=k0.stride(2), num_blocks=k0.shape[0],
            block_size=k0.shape[2], parallel_min_macs=quant_gemv.PARALLEL_MIN_MACS,
        )  # fmt: skip
        return decoder, (weights, tables, kv_cache)  # (kept alive while it reads them)


def _run(decoder, settings: dict, h, residual, metas) -> None:
    """The step through the decoder: h [T, H] (the first layer's normed input; the final
    normed output) and residual [T, H] in place, fp32 contiguous; metas: the step's
    AttentionMetadata per KV layer group (one for a cache of one table), as the model's
    _layer_metas checked and made them."""
    m = h.shape[0]
    if not (
        h.is_contiguous()
        and residual.is_contiguous()
        and h.dtype == residual.dtype == torch.float32
    ):
        raise ValueError("the decoder's h and residual must be contiguous float32")
    meta = metas[0]
    ints = attention_kernel.as_int32
    positions, cu_seqlens, seq_lens = (
        ints(meta.positions),
        ints(meta.cu_seqlens),
        ints(meta.seq_lens),
    )
    if positions.shape[0] < m or seq_lens.shape[0] < cu_seqlens.shape[0] - 1:
        raise ValueError(f"the step's metadata is shorter than its {m} rows or its chunks")
    kept, tables = [], []  # (the group tensors stay alive through the call)
    for group in metas:
        slots, table = ints(group.slot_mapping), ints(group.block_tables)
        if slots.shape[0] < m:
            raise ValueError(f"slot_mapping {tuple(slots.shape)}: fewer than the {m} rows")
        kept += [slots, table]
        tables.append((slots.data_ptr(), table.data_ptr(), table.stride(0), table.shape[1]))
    decoder.run(
        m, h.data_ptr(), residual.data_ptr(), positions.data_ptr(), cu_seqlens.data_ptr(),
        seq_lens.data_ptr(), cu_seqlens.shape[0] - 1, tables, meta.block_tables.shape[0],
        settings["threads"], settings["path"], settings["activation_bits"],
    )  # fmt: skip
