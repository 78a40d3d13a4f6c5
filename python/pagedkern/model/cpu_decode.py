"""The CPU decode step: LlamaModel.hidden_states for a batch of one-token decode rows on the
CPU, in as few torch ops per layer as the math allows.

On the CPU the reference ops are the model's kernels, and at decode their per-op cost (argument
checks, per-layer page gathers, dtype round trips: ~60 small ops a layer) outweighed the GEMMs.
This path computes the plain forward's (llama.py) function with ~20 ops a layer:

- once per step: every layer's K/V pages of the batch gathered into one float32 copy
  (reference.attention.gather_decode_kv) and viewed as each layer's attention operands, the
  softmax mask, the RoPE rows of the positions. The copy is kept to the next step, which
  reuses it when it only appends a token to each of the same sequences in the same rows and
  the same padded length (15 of 16 steps of a steady batch, staggered lengths too): this
  step's new K/V go into the copy as well as the cache, so the copy is then what a fresh
  gather would read;
- per layer: residual add and RMSNorm (torch's fused rms_norm), the GEMMs on the prepacked
  weights (quantized: the backend's, as ops.quant_linear runs them: the CPU backend's GEMV,
  or torch's int-pack kernels with bf16 activations),
  RoPE of q and k in place (rotate-half as roll, multiply, add), the new k/v written into the
  gathered copy (one index_copy_; an fp8 cache: as the cache stores them, k / k_scale and
  v / v_scale in E4M3, read back), attention as the CPU backend's decode rows compute it
  (ops/cpu/attention.tiled_attention: tiles of keys merged by an online softmax; one tile, so
  the reference's bmm / softmax / bmm, while the keys fit in one; fp8: the scores times
  k_scale, the output times v_scale, where reference.paged_attention applies them), SwiGLU in
  fp32;
- once per step: the new tokens' k/v written back into the paged cache (one scatter).

Bit for bit the plain path's result on the CPU backend (ops/cpu/), and on the reference while
the keys fit in one tile: every op rounds where the plain path's op does (no FMA where it
multiplies and adds; the attention is the backend's own tiles on the same operands),
tests/test_cpu_decode.py asserts torch.equal. So a
decode row's logits do not depend on whether its step took this path (decode-only steps) or
the plain one (steps with a prefill chunk), and the engine keeps greedy outputs independent of
batch make-up with it on. Used only where it computes exactly the plain path's function (see
`applies`); everything else takes the plain path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops import cpu as cpu_ops
from ..ops import launch
from ..ops.cpu import quant_gemv
from ..ops.cpu.attention import key_tile, tiled_attention
from ..ops.cpu.int_pack import cpu_packed
from ..reference.attention import MIN_GEMM_ROWS, decode_bias, gather_decode_kv
from ..reference.rope import quantize_e4m3
from .attention_metadata import AttentionMetadata
from .kv_cache import KVCache
from .quantized_linear import QuantizedWeight

Gemm = Callable[[torch.Tensor], torch.Tensor]


def applies(model, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
    """Decode-only batch of an fp32 single-rank model on the CPU (its KV cache fp32 or fp8, not
    calibrating fp8 scales), every row a real sequence (length >= 1, position = length - 1), no
    bias but QKV's; under the "cpu" backend (and "auto" on the CPU) at any length, under
    "reference" only while every sequence's keys fit in one tile of the CPU backend's attention
    (there the tiles compute the reference's function bit for bit; past it the reference's
    plain path runs, so the reference backend's outputs stay the reference's)."""
    if (
        meta.num_prefills
        or meta.num_tokens == 0
        or model.device.type != "cpu"
        or model.dtype != torch.float32
        or model.tp.size != 1
        or model._kv_amax is not None
        or kv_cache.groups is not None  # its gather reads one block table for every layer
        or launch.get_backend() == "cuda"  # which never runs CPU tensors on the reference
    ):
        return False
    if model._cpu_decode is None:
        model._cpu_decode = _prepare(model)
    if model._cpu_decode is False:
        return False
    lengths, positions = meta.seq_lens.tolist(), meta.positions.tolist()
    if min(lengths) < 1 or min(meta.slot_mapping.tolist()) < 0:
        return False
    if launch.get_backend() == "reference" and max(lengths) > key_tile(kv_cache.block_size):
        return False
    return all(p == n - 1 for p, n in zip(positions, lengths, strict=True))


class GatheredKV(NamedTuple):
    """A step's gathered K/V copy and what it was gathered for (LlamaModel._cpu_decode_kv)."""

    cache: torch.Tensor  # the paged cache's data it copies
    used: torch.Tensor  # [G, blocks] bool: the blocks its sequences' lengths reach
    pages: torch.Tensor  # [G, blocks] the block ids it read there (0 elsewhere)
    lengths: list[int]  # the sequences' lengths, this step's token included
    kv: torch.Tensor  # [L, 2, Hkv, G, P, D]


def _gathered_kv(model, kv_cache: KVCache, block_tables: torch.Tensor, lengths: list[int]):
    """This step's gathered K/V: the last step's copy when each row is the same sequence one
    token on (lengths + 1, the same padded length, the same block ids wherever the last
    lengths reached; one sequence per row, so no row's copy holds another row's K/V), else a
    fresh gather (slots past a length zeroed, as the reference's). The last copy's slots below
    its lengths are the cache's, the new one's included (written into both); slots at or past
    them are what this step's gather would leave there: zero (a block a sequence enters now,
    whose one slot in reach is this step's token, included). So a batch of staggered lengths,
    where every step some sequence starts a block, keeps its copy until the longest one starts
    a block."""
    last, model._cpu_decode_kv = model._cpu_decode_kv, None
    block_size = kv_cache.block_size
    nblk = -(-max(lengths) // block_size)
    tables = block_tables[:, :nblk]
    starts = torch.arange(0, nblk * block_size, block_size)
    used = starts[None, :] < torch.tensor(lengths)[:, None]
    if not (
        last is not None
        and last.cache is kv_cache.data
        and last.used.shape == used.shape
        and all(n == m + 1 for n, m in zip(lengths, last.lengths, strict=True))
        and torch.equal(tables.masked_fill(~last.used, 0), last.pages)
    ):
        last = None  # (dropped before the new gather: never two copies alive)
        kv = gather_decode_kv(kv_cache.data, block_tables, lengths)
    else:
        kv = last.kv
    return kv, GatheredKV(kv_cache.data, used, tables.masked_fill(~used, 0), lengths, kv)


def _new_kv_targets(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each layer's new K/V go in the gathered copy: (source row, destination row,
    position). A row's own K/V go into its own copy; rows of one sequence (speculative
    verification: 1 + k rows sharing a block table, row j at position computed + j) also read
    the new K/V of the rows before them, which reach the paged cache only after the last layer,
    so those go into the later rows' copies too. Different sequences always differ in the
    block holding their current position, so equal tables mean one sequence."""
    tables, positions = meta.block_tables, meta.positions.long()
    rows = torch.arange(tables.shape[0])
    if tables.shape[0] < 2:
        return rows, rows, positions
    # Equal tables have equal weighted sums, so distinct sums prove one sequence a row (a 1-D
    # unique: ~20x cheaper than unique(dim=0)'s row sort at 256 rows); a tie is rechecked.
    # Random 64-bit weights (the sum wraps): with weights 1, 2, 3, ... the engine's tables of
    # consecutive block ids tied in 22 of 30 steps at 256 rows.
    sums = (tables.long() * _table_weights(tables.shape[1])).sum(1)
    if sums.unique().numel() == tables.shape[0]:
        return rows, rows, positions
    _, group = torch.unique(tables, dim=0, return_inverse=True)
    if int(group.max()) + 1 == tables.shape[0]:
        return rows, rows, positions
    src, dst = (
        (group[:, None] == group[None, :]) & (positions[:, None] <= positions[None, :])
    ).nonzero(as_tuple=True)
    return src, dst, positions[src]


@functools.cache
def _table_weights(width: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(width)
    return torch.randint(-(2**62), 2**62, (width,), dtype=torch.int64, generator=generator)


def _gemm(weight, bias: torch.Tensor | None = None) -> Gemm:
    """x [M, K] -> x @ W.T (+ bias) as the plain path's linear computes it under the backend in
    effect at the call: quantized weights on the CPU backend through its quant_linear (fp32 in,
    x's dtype out), else torch's int-pack kernels (bf16 in and out; x arrives in bf16, see
    _gemm_dtype); fp32 weights by F.linear."""
    if isinstance(weight, QuantizedWeight):
        host = cpu_ops.implementation_of("quant_linear")
        n = weight.shape[0]

        def mm(x):
            if x.dtype == torch.float32:  # the CPU backend's (_gemm_dtype)
                return host(x, weight)
            w, scales = cpu_packed(weight)
            if weight.format == "int8":
                return torch.ops.aten._weight_int8pack_mm(x, w, scales)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, weight.group_size, scales)
            return out[:, :n] if out.shape[1] != n else out
    else:
        mm = lambda x: F.linear(x, weight)  # noqa: E731
    if bias is None:
        return mm
    return lambda x: mm(x).float().add_(bias)


# The ModelConfig fields this path implements; any other field off its default (the Gemma
# options: GeGLU, sandwich norms, embedding and attention scales, soft-caps, sliding windows, a
# local RoPE base; whatever is added later) sends the model to the plain path, so no option is
# ever silently ignored.
_COMPUTED_FIELDS = {
    "name", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias",
    "qk_norm",
}  # fmt: skip


def _computes(config) -> bool:
    """Whether this path computes the config's forward (see _COMPUTED_FIELDS)."""
    return all(
        getattr(config, f.name) == f.default
        for f in dataclasses.fields(config)
        if f.name not in _COMPUTED_FIELDS
    )


def _prepare(model):
    """Per layer (qkv, o, gate_up, down) GEMM closures, or False where the path does not compute
    the model's forward (_computes), some weight has a bias the fast path does not place exactly
    as the plain one (O, gate/up, down biases) or the model normalises q and k (QK-norm)."""
    if not _computes(model.config):
        return False
    layers = []
    for layer in model.weights.layers:
        if any(b is not None for b in (layer.o_bias, layer.gate_up_bias, layer.down_bias)):
            return False
        if layer.q_norm is not None:  # QK-norm (Qwen3): the plain forward's
            return False
        layers.append(
            (_gemm(layer.qkv, layer.qkv_bias), _gemm(layer.o), _gemm(layer.gate_up),
             _gemm(layer.down))
        )  # fmt: skip
    return layers


def _gemm_dtype(weight) -> torch.dtype:
    """What the plain path's linear rounds x to: bf16 for quantized weights on torch's int-pack
    kernels (the reference backend, or the CPU backend without its built GEMV), else fp32."""
    if not isinstance(weight, QuantizedWeight):
        return torch.float32
    on_gemv = launch.get_backend() != "reference" and quant_gemv.available()
    return torch.float32 if on_gemv else torch.bfloat16


def hidden_states(
    model, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
) -> torch.Tensor:
    """Final-normed hidden states [T, H] fp32 of T decode rows (one per sequence)."""
    cfg, w = model.local, model.weights
    eps, hkv, d, hidden = cfg.rms_norm_eps, cfg.num_kv_heads, cfg.head_dim, (cfg.hidden_size,)
    tokens, heads, group = (
        input_ids.shape[0],
        cfg.num_heads + cfg.num_kv_heads,
        cfg.num_heads // hkv,
    )
    q_size, qk_size, inter = cfg.q_size, cfg.q_size + cfg.kv_size, cfg.intermediate_size
    lengths = meta.seq_lens.tolist()
    kv, gathered = _gathered_kv(model, kv_cache, meta.block_tables, lengths)  # [L,2,Hkv,G,P,D]
    layers, padded = kv.shape[0], kv.shape[4]
    bias = decode_bias(lengths, padded, hkv)
    rows = torch.arange(tokens)
    positions = meta.positions.long()  # = lengths - 1: the new token's slot in `kv`
    src, dst, dst_positions = _new_kv_targets(meta)
    # New k/v rows -> flat (sequence, slot) rows of a layer's copy: one index_copy_ a layer.
    kv_rows = kv.view(*kv.shape[:3], -1, d)  # [L, 2, Hkv, G * P, D]
    dst_rows = dst * padded + dst_positions
    src = None if torch.equal(src, rows) else src
    # Attention operands of every layer shaped as reference.paged_attention_gathered shapes
    # them (the same bmm / softmax / bmm on the same strides: the same bits), views taken once
    # per step instead of once per layer; views, never copies, so they see each layer's new k/v.
    keys = kv[:, 0].view(layers, hkv * tokens, padded, d).transpose(2, 3)
    values = kv[:, 1].view(layers, hkv * tokens, padded, d)
    # RoPE rows: x' = x * [cos, cos] + roll(x, D/2) * [-sin, sin] (roll(x) = [x2, x1]).
    table = model.cos_sin[positions]
    cos, sin = table[:, None, : d // 2], table[:, None, d // 2 :]
    cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
    scale: float | None = d**-0.5
    fp8_scales = kv_cache.scales if kv_cache.is_fp8 else None  # per layer (k, v)
    if math.frexp(scale)[0] == 0.5 and fp8_scales is None:
        # A power-of-two softmax scale (D = 64, 256) rides on q's RoPE rows: scaling by 2^-k
        # commutes with every rounding, so the bmm yields the reference's scores * scale, bit
        # for bit, without a multiply a layer.
        cos2, sin2 = cos2.repeat(1, heads, 1), sin2.repeat(1, heads, 1)
        cos2[:, : cfg.num_heads].mul_(scale)
        sin2[:, : cfg.num_heads].mul_(scale)
        scale = None
    tile = key_tile(kv_cache.block_size)

    def hide(scores: torch.Tensor, c0: int, c1: int) -> None:  # the -inf past each length
        if bias is not None:
            scores.add_(bias[..., c0:c1])

    attn_in = torch.empty(tokens, q_size, dtype=_gemm_dtype(w.layers[0].o))
    attn_heads = attn_in.view(tokens, hkv, group, d)
    # Query rows per (kv head, sequence) GEMM, zero-padded as reference.paged_attention pads
    # them (MIN_GEMM_ROWS): the pad rows stay zero, each layer writes the real ones.
    q_rows = max(group, MIN_GEMM_ROWS)
    q_padded = torch.zeros(hkv, tokens, q_rows, d)
    q_real = q_padded[:, :, :group]
    act = torch.empty(tokens, inter, dtype=_gemm_dtype(w.layers[0].down))

    residual = model._embed(input_ids)
    h = torch.rms_norm(residual, hidden, w.layers[0].input_norm, eps)
    for i, (layer, (qkv_mm, o_mm, gate_up_mm, down_mm)) in enumerate(
        zip(w.layers, model._cpu_decode, strict=True)
    ):
        if i:
            residual.add_(h)
            h = torch.rms_norm(residual, hidden, layer.input_norm, eps)
        qkv = qkv_mm(h.to(_gemm_dtype(layer.qkv))).float()
        qk = qkv[:, :qk_size].view(tokens, heads, d)
        rolled = qk.roll(d // 2, dims=-1).mul_(sin2)  # not addcmul: its FMA rounds apart
        qk.mul_(cos2).add_(rolled)
        new_kv = qkv[:, q_size:].view(tokens, 2, hkv, d).permute(1, 2, 0, 3)
        if fp8_scales is not None:  # what the cache stores, as attention reads it back
            k_scale, v_scale = fp8_scales[i]
            new_kv = torch.stack(
                (quantize_e4m3(new_kv[0], k_scale), quantize_e4m3(new_kv[1], v_scale))
            ).float()
        kv_rows[i].index_copy_(2, dst_rows, new_kv if src is None else new_kv[:, :, src])
        q_real.copy_(qk[:, : cfg.num_heads].view(tokens, hkv, group, d).transpose(0, 1))
        out, _ = tiled_attention(  # [Hkv * G, q_rows, D], as the CPU backend's decode rows
            q_padded.view(hkv * tokens, q_rows, d),
            keys[i],
            values[i],
            scale * k_scale if fp8_scales is not None else scale,
            hide,
            padded,
            tile,
            open_until=min(lengths),
            alive_until=1,
        )
        out = out.view(hkv, tokens, q_rows, d)[:, :, :group]
        if fp8_scales is not None:
            out.mul_(v_scale)
        attn_heads.copy_(out.transpose(0, 1))
        residual.add_(o_mm(attn_in))
        h = torch.rms_norm(residual, hidden, layer.post_norm, eps)
        gate_up = gate_up_mm(h.to(_gemm_dtype(layer.gate_up))).float()
        gate = F.silu(gate_up[:, :inter], inplace=True)
        torch.mul(gate, gate_up[:, inter:], out=act)
        h = down_mm(act)
    residual.add_(h)
    # The new tokens' k/v of every layer into their cache slots, in one scatter.
    slot_mapping = meta.slot_mapping.long()
    block_size = kv_cache.block_size
    data = kv_cache.data
    data[:, :, slot_mapping // block_size, :, slot_mapping % block_size] = (
        kv[:, :, :, rows, positions].permute(3, 0, 1, 2, 4).to(data.dtype)
    )
    if src is None:  # one sequence per row: the next step may reuse the copy
        model._cpu_decode_kv = gathered
    return torch.rms_norm(residual, hidden, w.norm, eps)
