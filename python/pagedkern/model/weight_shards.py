"""One rank's shard of weights already loaded whole (fused QKV and gate/up, stacked experts): the
parts tensor_shard.TensorShard names, cut out of the fused tensors. Used where a model exists
whole in memory (synthetic weights, a model loaded before its group started); the checkpoint
loaders read the same parts straight from the file instead.

Quantized weights are sliced in their packed form: int8 (per output channel) along rows or
columns; int4 along rows, or along columns at group boundaries; stacked experts (expert
parallelism) along the expert dim, whole.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from .config import ModelConfig
from .quantized_linear import QuantizedWeight, quantize_int8_grouped
from .tensor_shard import TensorParallelConfigError, TensorShard
from .weights import LayerWeights, Linear, LlamaWeights


def _index(*ranges: range) -> torch.Tensor:
    return torch.cat([torch.arange(r.start, r.stop) for r in ranges])


def rows(w: Linear, index: torch.Tensor) -> Linear:
    """Rows `index` of w [N, K] (or of every expert's, stacked [E, N, K])."""
    if not isinstance(w, QuantizedWeight):
        return w[..., index, :].contiguous()

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        rows_last = t.dim() < w.qweight.dim()  # per-channel int8's one scale per row
        return (t[..., index] if rows_last else t[..., index, :]).contiguous()

    shape = (*w.shape[:-2], len(index), w.shape[-1])
    return QuantizedWeight(
        w.format, shape, cut(w.qweight), cut(w.scales), cut(w.mins), w.group_size,
        input_index=w.input_index,
    )  # fmt: skip


def cols(w: Linear, start: int, stop: int, what: str) -> Linear:
    """Columns [start, stop) of w [N, K] (or of every expert's, stacked [E, N, K])."""
    if not isinstance(w, QuantizedWeight):
        return w[..., start:stop].contiguous()
    shape = (*w.shape[:-1], stop - start)
    g = w.group_size
    if w.input_index is not None:  # act-order: a rank's inputs are spread over every group
        return _act_order_cols(w, start, stop)
    if w.format == "int8" and not w.int8_per_group:  # one scale per row: a column slice keeps it
        return QuantizedWeight("int8", shape, w.qweight[..., start:stop].contiguous(), w.scales)
    if start % g or stop % g:
        alternative = "int8 or none" if w.format == "int4" else "none"
        raise TensorParallelConfigError(
            f"{what}: an {w.format} column shard [{start}, {stop}) does not fall on group "
            f"boundaries (group size {g}); use --quantization {alternative} with this "
            "tensor_parallel_size"
        )
    q = w.qweight[..., start:stop] if w.int8_per_group else w.qweight[..., start // 2 : stop // 2]
    mins = None if w.mins is None else w.mins[..., start // g : stop // g]
    return QuantizedWeight(
        w.format,
        shape,
        q.contiguous(),
        w.scales[..., start // g : stop // g].contiguous(),
        None if mins is None else mins.contiguous(),
        g,
    )


def _act_order_cols(w: QuantizedWeight, start: int, stop: int) -> Linear:
    """Input channels [start, stop) of an act-order weight: their stored columns fill each
    group only in part, so they are requantized to int8 in groups of 32 (within 1/254 of each
    group's largest weight: finer than the checkpoint's own 4-bit step), floats where the
    width is not a multiple of 32."""
    part = w.dequantize_rows()[:, start:stop]
    return quantize_int8_grouped(part, 32) if part.shape[1] % 32 == 0 else part


def experts(w: Linear, ids: range) -> Linear:
    """Experts `ids` of a stacked [E, N, K] weight, whole (a float tensor or a QuantizedWeight,
    whose packed parts are stacked the same way)."""
    if not isinstance(w, QuantizedWeight):
        return w[ids.start : ids.stop].contiguous()

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[ids.start : ids.stop].contiguous()

    shape = (len(ids), *w.shape[1:])
    return QuantizedWeight(
        w.format, shape, cut(w.qweight), cut(w.scales), cut(w.mins), w.group_size
    )


def _bias(b: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if b is None else b[index].contiguous()


def shard_weights(
    weights: LlamaWeights,
    config: ModelConfig,
    rank: int,
    size: int,
    expert_parallel: bool = False,
) -> LlamaWeights:
    """Rank `rank`'s slice of every weight (the input is left untouched); expert_parallel: a
    MoE layer's experts whole, this rank's (TensorShard.experts)."""
    shard = TensorShard(rank, size, expert_parallel)
    shard.check(config)
    if size == 1:
        return weights
    q_rows, kv_rows = shard.q_rows(config), shard.kv_rows(config)
    k_off, v_off = config.q_size, config.q_size + config.kv_size
    qkv = _index(
        q_rows,
        range(kv_rows.start + k_off, kv_rows.stop + k_off),
        range(kv_rows.start + v_off, kv_rows.stop + v_off),
    )

    def gate_up(intermediate: int) -> torch.Tensor:
        part = shard.mlp_rows(intermediate)
        return _index(part, range(part.start + intermediate, part.stop + intermediate))

    def layer(w: LayerWeights, n: int) -> LayerWeights:
        moe = w.router is not None
        mlp = shard.mlp_rows(config.shared_expert_size if moe else config.intermediate_size)
        mlp_index = gate_up(config.shared_expert_size if moe else config.intermediate_size)
        out = LayerWeights(
            input_norm=w.input_norm,
            qkv=rows(w.qkv, qkv),
            o=cols(w.o, q_rows.start, q_rows.stop, f"layer {n} o_proj"),
            post_norm=w.post_norm,
            gate_up=None if w.gate_up is None else rows(w.gate_up, mlp_index),
            down=None
            if w.down is None
            else cols(w.down, mlp.start, mlp.stop, f"layer {n} down_proj"),
            qkv_bias=_bias(w.qkv_bias, qkv),
            o_bias=w.o_bias if rank == 0 else None,  # added once, before the all-reduce
            gate_up_bias=_bias(w.gate_up_bias, mlp_index),
            down_bias=w.down_bias if rank == 0 else None,
            q_norm=w.q_norm,  # per head: every rank's heads take the same weights
            k_norm=w.k_norm,
            attn_out_norm=w.attn_out_norm,  # of the all-reduced output: whole on every rank
            mlp_out_norm=w.mlp_out_norm,
            sinks=_bias(w.sinks, _index(shard.heads(config))),  # (gpt-oss) its query heads'
        )
        if moe and expert_parallel:  # this rank's experts whole, with their biases
            ids = shard.experts(config)
            out.router, out.shared_gate, out.router_bias = w.router, w.shared_gate, w.router_bias
            out.experts_gate_up = experts(w.experts_gate_up, ids)
            out.experts_down = experts(w.experts_down, ids)
            for name in ("experts_gate_up_bias", "experts_down_bias"):  # (gpt-oss) [E, rows]
                b = getattr(w, name)
                setattr(out, name, None if b is None else b[ids.start : ids.stop].contiguous())
        elif moe:  # the router and the shared expert's gate replicated, every expert sliced
            experts_rows = shard.mlp_rows(config.moe_intermediate_size)
            out.router, out.shared_gate = w.router, w.shared_gate
            out.experts_gate_up = rows(w.experts_gate_up, gate_up(config.moe_intermediate_size))
            out.experts_down = cols(
                w.experts_down, experts_rows.start, experts_rows.stop, "experts"
            )
            out.router_bias = w.router_bias  # (gpt-oss) replicated with the router
            if w.experts_gate_up_bias is not None:  # [E, 2I]
                index = gate_up(config.moe_intermediate_size)
                out.experts_gate_up_bias = w.experts_gate_up_bias[:, index].contiguous()
            out.experts_down_bias = w.experts_down_bias if rank == 0 else None
        rank0_only = ("o_bias", "down_bias", "experts_down_bias")
        unsplit = [f.name for f in fields(w) if getattr(out, f.name) is None]
        unsplit = [x for x in unsplit if x not in rank0_only]
        if any(getattr(w, name) is not None for name in unsplit):  # (no rule for them yet)
            raise TensorParallelConfigError(
                f"layer {n}: tensor parallelism has no rule to split "
                f"{', '.join(x for x in unsplit if getattr(w, x) is not None)}"
            )
        return out

    vocab = _index(shard.vocab(config))
    embed = rows(weights.embed, vocab)
    head = embed if weights.tied else rows(weights.lm_head, vocab)
    return LlamaWeights(
        embed,
        [layer(w, n) for n, w in enumerate(weights.layers)],
        weights.norm,
        head,
        weights.rope_freq_factors,
    )
