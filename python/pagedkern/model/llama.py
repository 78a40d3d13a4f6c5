"""The Llama-family forward over the paged KV cache, written only against pagedkern ops (plus
torch GEMMs and the embedding lookup), so one model file serves every backend: the CUDA
kernels, the CPU backend and the reference ops.

Per layer: fused add+RMSNorm, one fused QKV GEMM, rope_and_cache (rotate q/k, write k/v pages
through slot_mapping), flash_prefill on the prefill rows and paged_attention on the decode rows,
O GEMM, fused add+RMSNorm, one fused gate/up GEMM, silu_and_mul, down GEMM. Then the final norm
and the LM head on the requested rows only. Norm statistics, softmax and logits are fp32.

Each op runs its backend's implementation (`--backend`: the CUDA kernels, the CPU backend's
ops/cpu/, the reference). On the CPU backend a step resolves the table once (`_step_ops`): its
arguments are the model's own tensors, so the step's indices are checked once and every layer
calls ops/cpu/'s functions without the ops layer's per-call validation: each layer's attention
is one C++ call over every row of the step, and a quantized fp32 model's layers are one C++
call (cpu_step.py).

Gemma 2 / 3 on the same loop: embeddings times sqrt(hidden), QK-norm (Gemma 3; qk_norm.py), the
attention scale, soft-cap and sliding window of each layer passed to the attention ops, its own
RoPE table for sliding layers (Gemma 3), an RMSNorm of the attention output and of the MLP
output before their residual adds (sandwich norms), GeGLU, and the final logits soft-capped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from ..ops import launch, shadow
from ..ops.cpu.direct import direct_cpu_calls
from .attention_metadata import AttentionMetadata
from .collectives import SINGLE, Collectives
from .config import ModelConfig
from .cpu_step import CpuStep
from .kv_cache import FP8, KVCache, KVLayerGroups, allocate_kv_cache, kv_element
from .linear import LogitsProjection, linear
from .moe import moe_mlp
from .qk_norm import qk_norms
from .quantized_linear import QuantizedWeight
from .rope import rope_table
from .step_attention import StepAttention
from .weights import LayerWeights, Linear, LlamaWeights


class LlamaModel:
    """A loaded model: config, weights (device, dtype) and its RoPE table.

    forward(input_ids, meta, kv_cache) -> logits [len(meta.logits_indices), vocab] float32.

    Tensor parallel (tp.size > 1): `weights` are this rank's shard (parallel/shard.py) and
    `local` the shape it computes; the forward all-reduces where the residual add is and
    gathers the LM head's vocabulary shards to rank 0 (None on the other ranks).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: LlamaWeights,
        max_positions: int | None = None,
        kv_cache_dtype: str = "auto",
        tp: Collectives = SINGLE,
        local: ModelConfig | None = None,
    ):
        self.config = config
        self.tp = tp
        self.local = local or config  # this rank's heads, intermediate and vocabulary rows
        if tp.size > 1 and kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype fp8 is not supported with tensor parallelism yet")
        self.weights = weights
        self.device = weights.norm.device
        self.dtype = weights.norm.dtype  # activations; linear weights may be quantized
        self.quantization = weights.quantization
        self.kv_cache_dtype = kv_cache_dtype
        # the KV cache's elements
        self.kv_dtype = kv_element(kv_cache_dtype, self.dtype, self.device.type)
        self._kv_scales: list[tuple[float, float]] | None = None  # fp8: calibrated once
        self._kv_amax: list[tuple[float, float]] | None = None  # collects |k|, |v| maxima
        self.max_positions = max_positions or config.max_position_embeddings
        # [max_positions, D] fp32 cos|sin, frequencies already scaled (Llama 3, GGUF factors).
        self.cos_sin = rope_table(
            config, self.max_positions, self.device, weights.rope_freq_factors
        )
        # Gemma 3's sliding layers rotate by a base of their own, unscaled
        self.cos_sin_local = self.cos_sin
        if config.rope_local_theta is not None:
            local = config.replace(rope_theta=config.rope_local_theta, rope_scaling=None)
            self.cos_sin_local = rope_table(local, self.max_positions, self.device)
        # in the activation dtype, as transformers multiplies (sqrt(3072) is 55.5 in bf16)
        scale = config.embed_scale
        self._embed_scale = None if scale is None else float(torch.tensor(scale, dtype=self.dtype))
        self._layer_index: dict[int, int] = {}  # id(LayerWeights) -> its layer (_attention)
        self._logits = LogitsProjection(config.final_soft_cap)
        self._ops = ops  # the step's op table (_step_ops)
        self._cpu = CpuStep(self.local, tp.size) if self.device.type == "cpu" else None
        self._tail = None  # the step's fused layer tail (the CPU backend's, where it runs)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int = 16, groups: KVLayerGroups | None = None
    ) -> KVCache:
        """A KV cache for this model on its device, in kv_dtype (fp8: with per-layer scales);
        groups: per-kind block tables (model/kv_cache.py)."""
        scales = self.kv_scales() if self.kv_dtype == FP8 else None
        return allocate_kv_cache(
            self.local, num_blocks, block_size, self.device, self.kv_dtype, scales, groups
        )

    def kv_scales(self, tokens: int = 256) -> list[tuple[float, float]]:
        """Per-layer fp8 scales (k, v): the largest |k| / |v| of a calibration prefill of
        `tokens` fixed pseudo-random ids, mapped to half of E4M3's range (448), so later
        outliers up to twice the calibration maximum still fit before saturating."""
        if self._kv_scales is None:
            from .attention_metadata import SequenceChunk, build_batch

            ids = (torch.arange(tokens) * 7919 % self.config.vocab_size).tolist()
            block = 16
            blocks = -(-tokens // block)
            kv = allocate_kv_cache(self.config, blocks, block, self.device, self.dtype)
            chunk = SequenceChunk(ids, 0, list(range(blocks)))
            input_ids, meta = build_batch([chunk], block, self.device)
            self._kv_amax = []
            try:
                self.hidden_states(input_ids, meta, kv)
                amax = self._kv_amax
            finally:
                self._kv_amax = None
            self._kv_scales = [(max(k, 1e-6) / 224.0, max(v, 1e-6) / 224.0) for k, v in amax]
        return self._kv_scales

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: StepAttention | None = None,
    ) -> torch.Tensor:
        """input_ids [T] int32 (rows laid out as `meta` says); writes this step's k/v into
        kv_cache; returns float32 logits for the rows meta.logits_indices selects.
        attention: the step's planned attention over `meta` (default: planned here)."""
        hidden = self.hidden_states(input_ids, meta, kv_cache, attention)
        return self.tp.gather_logits(
            self.compute_logits(hidden.index_select(0, meta.logits_indices))
        )

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final hidden states -> [N, vocab] float32 logits (this rank's vocabulary
        rows under tensor parallelism; model/linear.py LogitsProjection)."""
        table = self._ops  # (the last step's: its quant_linear where it still applies)
        direct = table is not ops and direct_cpu_calls(self.device)
        return self._logits(hidden, self.weights.lm_head, table if direct else None)

    @torch.inference_mode()
    def describe(self) -> str:
        """One line for --trace / --stats: the model, its weight and KV formats and sizes."""
        kv = "fp8 (E4M3, per-layer scales)" if self.kv_dtype == FP8 else str(self.kv_dtype)
        kv = kv.replace("torch.", "")
        mib = self.weights.nbytes / 2**20
        tp = f", tensor parallel {self.tp.size} (rank 0's shard)" if self.tp.size > 1 else ""
        if self.tp.size > 1 and self.tp.expert_parallel and self.config.num_experts:
            tp = tp.replace("(rank 0's", "with whole experts (rank 0's")
        return (
            f"{self.config.name}: weights {self.quantization} ({mib:.0f} MiB), "
            f"activations {str(self.dtype).replace('torch.', '')}, KV cache {kv}{tp}"
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: StepAttention | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of every row, [T, H] in the model dtype (attention: as
        forward's)."""
        cfg, w = self.local, self.weights
        if kv_cache.num_layers != cfg.num_layers:
            raise ValueError(f"KV cache has {kv_cache.num_layers} layers, model {cfg.num_layers}")
        self._ops = self._step_ops(meta, kv_cache)
        decoder = None if attention is not None else self._decoder_for_step(kv_cache)
        if attention is None and decoder is None:  # planned by each kind's first layer, run by all
            copies = None if self._cpu is None else self._cpu.decode_copies
            attention = StepAttention(meta, copies)
        tokens = input_ids.shape[0]
        shadow.enter_layer(0)  # (shadow mode: which layer the op calls that follow belong to)
        h, residual = self.embed_and_norm(input_ids, w.layers[0].input_norm)
        metas, group_of = _layer_metas(meta, kv_cache)
        if decoder is not None:
            decoder(h, residual, metas)
            shadow.enter_layer(None)
            return h
        attn = torch.empty(
            tokens, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device
        )
        scales = kv_cache.scales or [None] * cfg.num_layers
        for i, (layer, (k_cache, v_cache), kv_scale) in enumerate(
            zip(w.layers, kv_cache.layers, scales, strict=True)
        ):
            shadow.enter_layer(i)
            qkv = self._linear(h, layer.qkv, layer.qkv_bias)
            layer_meta = metas[group_of[i]] if group_of else meta
            self._attention(qkv, layer, layer_meta, k_cache, v_cache, attn, kv_scale, i, attention)
            h, residual = self.layer_tail(attn, residual, layer, self.next_norm(i))
        shadow.enter_layer(None)  # the LM head belongs to no layer
        return h

    # The layer loop in pieces, shared with engine/piecewise_graphs.py, which captures the work
    # between two attentions (layer_tail, then the next QKV GEMM) as one CUDA graph.

    def embed_and_norm(
        self, input_ids: torch.Tensor, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(first layer's normed input, residual stream): the embedding is the residual."""
        residual = self._embed(input_ids)
        if self._embed_scale is not None:
            residual.mul_(self._embed_scale)
        return self._ops.rms_norm(residual, norm, self.local.rms_norm_eps), residual

    def _step_ops(self, meta: AttentionMetadata, kv_cache: KVCache):
        """The step's op table (model/cpu_step.py on the CPU; else `pagedkern.ops`), and its
        fused layer tail into _tail."""
        if self._cpu is None:
            self._tail = None
            return ops
        table, self._tail = self._cpu.ops_for(meta, kv_cache, self.max_positions)
        return table

    def _decoder_for_step(self, kv_cache: KVCache):
        """The CPU backend's one-call decoder for this step (ops/cpu/decoder.py), or None: the
        layer loop runs (another backend, no fused tail, fp8 calibration, layers it refuses)."""
        if self._tail is None or self._kv_amax is not None or self.dtype != torch.float32:
            return None
        return self._cpu.decoder.for_step(
            self._tail, self.weights, self.cos_sin, self.cos_sin_local, kv_cache
        )

    def _linear(self, x: torch.Tensor, weight: Linear, bias: torch.Tensor | None = None):
        """linear() through the step's op table."""
        if self._ops is ops:
            return linear(x, weight, bias)
        launch.record_launch("gemm")
        if isinstance(weight, QuantizedWeight):
            return self._ops.quant_linear(x, weight, bias)
        return self._ops.dense_linear(x, weight, bias)

    def next_norm(self, layer: int) -> torch.Tensor:
        """The norm after layer `layer`: the next layer's input norm, the final norm last."""
        layers = self.weights.layers
        return layers[layer + 1].input_norm if layer + 1 < len(layers) else self.weights.norm

    def layer_tail(
        self,
        attn: torch.Tensor,
        residual: torch.Tensor,
        layer: LayerWeights,
        next_norm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer after attention: O GEMM, residual add + norm, gate/up GEMM, SiLU x mul (GeGLU:
        GELU-tanh), down GEMM, residual add + `next_norm`; with sandwich norms the O and down
        outputs are normed before their adds. residual is updated in place; returns (h,
        residual)."""
        if self._tail is not None:
            fused = self._tail(attn, residual, layer, next_norm)
            if fused is not None:
                return fused
        cfg, eps, o = self.local, self.local.rms_norm_eps, self._ops
        h = self._linear(attn.view(attn.shape[0], cfg.q_size), layer.o, layer.o_bias)
        h = self.tp.all_reduce(h)  # row-parallel O: sum the ranks' partial outputs
        if layer.attn_out_norm is not None:
            h = o.rms_norm(h, layer.attn_out_norm, eps)
        h, residual = o.fused_add_rms_norm(h, residual, layer.post_norm, eps)
        if layer.router is not None:  # a mixture-of-experts layer
            h = moe_mlp(h, layer, cfg, self._linear, self.tp)
        else:
            gate_up = self._linear(h, layer.gate_up, layer.gate_up_bias)
            if cfg.hidden_act == "gelu_tanh":
                act = o.gelu_tanh_and_mul(gate_up)
            else:
                act = o.silu_and_mul(gate_up)
            h = self._linear(act, layer.down, layer.down_bias)
        h = self.tp.all_reduce(h)  # row-parallel down, likewise
        if layer.mlp_out_norm is not None:
            h = o.rms_norm(h, layer.mlp_out_norm, eps)
        return o.fused_add_rms_norm(h, residual, next_norm, eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; vocab-parallel: this rank's rows, zeros elsewhere, all-reduced."""
        w, tp = self.weights.embed, self.tp
        launch.record_launch("embedding")
        ids = input_ids
        if tp.size > 1:
            ids = input_ids - tp.vocab_start
            outside = (ids < 0) | (ids >= self.local.vocab_size)
            ids = ids.masked_fill(outside, 0)
        if isinstance(w, QuantizedWeight) and self._ops is not ops:  # tied to a quantized head
            h = self._ops.dequantize_rows(w, ids, self.dtype)  # (the CPU backend's C++ rows)
        elif isinstance(w, QuantizedWeight):
            h = w.dequantize_rows(ids, self.dtype)
        else:  # (a 16-bit table under fp32 activations: rows widened, exactly)
            h = F.embedding(ids, w).to(self.dtype)
        if tp.size > 1:
            h = tp.all_reduce(h.masked_fill_(outside[:, None], 0))
        return h

    def _attention(
        self,
        qkv: torch.Tensor,
        layer: LayerWeights,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        kv_scale: tuple[float, float] | None = None,
        index: int | None = None,
        attention: StepAttention | None = None,
    ) -> None:
        """Attention of one layer (`index`, else found from `layer`): its q/k norms, RoPE and
        cache write, then flash_prefill on the prefill rows and paged_attention on the rest,
        with the layer's window and the model's scale and soft-cap, through the step's
        `attention` (planned by its first layer of each kind, run by the others)."""
        cfg = self.local
        if index is None:
            index = self._index_of(layer)
        window = cfg.layer_window(index)
        cos_sin = self.cos_sin if window is None else self.cos_sin_local
        options = dict(scale=cfg.attn_scale)
        if window is not None:
            options["sliding_window"] = window
        if cfg.attn_soft_cap is not None:
            options["soft_cap"] = cfg.attn_soft_cap
        if layer.sinks is not None:  # (gpt-oss) a learned logit per head joins every softmax
            options["sinks"] = layer.sinks
        # Head views into the fused output (token stride qkv_size): no copies.
        q, k, v = qkv.unflatten(1, (-1, cfg.head_dim)).split(
            (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads), dim=1
        )
        # QK-norm, fused into rope_and_cache unless fp8 calibration reads the normed k first
        q, k, norms = qk_norms(q, k, layer, cfg, fuse=self._kv_amax is None)
        if self._kv_amax is not None:  # fp8 calibration (kv_scales)
            self._kv_amax.append((k.abs().max().item(), v.abs().max().item()))
        # fp8 cache: rope_and_cache stores k / k_scale and v / v_scale (E4M3, saturated) and
        # paged_attention folds k_scale into the softmax scale and v_scale into its output:
        # attention over the dequantized cache, in the CUDA kernels on a GPU.
        scales = {} if kv_scale is None else {"k_scale": kv_scale[0], "v_scale": kv_scale[1]}
        self._ops.rope_and_cache(
            q, k, v, meta.positions, cos_sin, k_cache, v_cache, meta.slot_mapping, **scales,
            **norms,
        )  # fmt: skip
        if attention is None:  # (a caller outside a forward pass: plans for this call only)
            attention = StepAttention(meta)
        # fp8 too: E4M3 pages; a hybrid cache's layer reads its group's tables; k and v as
        # cached (the CPU backend's decode copies take them)
        attention(
            q, k_cache, v_cache, out, block_tables=meta.block_tables, k=k, v=v, **scales,
            **options,
        )  # fmt: skip

    def _index_of(self, layer: LayerWeights) -> int:
        """The layer number of `layer` (one of self.weights.layers)."""
        index = self._layer_index.get(id(layer))
        if index is None or self.weights.layers[index] is not layer:
            index = next(i for i, w in enumerate(self.weights.layers) if w is layer)
            self._layer_index[id(layer)] = index
        return index


def _layer_metas(
    meta: AttentionMetadata, kv_cache: KVCache
) -> tuple[list[AttentionMetadata], tuple[int, ...]]:
    """A hybrid cache's per-group metadata (model/kv_cache.py KVLayerGroups) and each layer's
    group; ([meta], ()) for a cache with one table."""
    groups = kv_cache.groups
    if groups is None:
        return [meta], ()
    if len(meta.group_block_tables) != groups.num_groups - 1:
        raise ValueError(
            f"the KV cache has {groups.num_groups} layer groups, the batch "
            f"{1 + len(meta.group_block_tables)} block tables"
        )
    return [meta.for_group(g) for g in range(groups.num_groups)], groups.layer_group
