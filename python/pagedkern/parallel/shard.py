"""Megatron-style slicing of a loaded model's weights for one rank.

Column-parallel (output rows split): QKV (this rank's query heads and their KV heads) and
gate/up (this rank's slice of the intermediate size, gate rows then up rows). Row-parallel
(input columns split): O and down, whose partial outputs the forward all-reduces; their biases
stay on rank 0 only, so the sum adds them once. Vocab-parallel: rank r holds embedding / LM head
rows [r*ceil(V/N), (r+1)*ceil(V/N)). Norms and RoPE factors are replicated.

KV heads: with num_kv_heads >= N each rank holds num_kv_heads / N of them; with fewer (as vLLM
does) each rank holds the one KV head its query heads read, replicated over N / num_kv_heads
ranks. Quantized weights are sliced in their packed form: int8 (per output channel) along rows
or columns; int4 along rows, or along columns at group boundaries.
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig
from ..model.quantized_linear import QuantizedWeight
from ..model.weights import LayerWeights, Linear, LlamaWeights


class TensorParallelConfigError(ValueError):
    """This model cannot be split over this many ranks (the message says why)."""


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Refuse a size the heads do not divide, with a message naming the counts."""
    hq, hkv = config.num_heads, config.num_kv_heads
    if size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.num_experts and size > 1:
        raise TensorParallelConfigError(
            f"{config.name} is a mixture of experts: tensor parallelism does not cover its "
            "experts yet; use tensor_parallel_size 1"
        )
    if hq % size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} does not divide {config.name}'s {hq} query heads "
            f"(divisors: {', '.join(str(d) for d in range(1, hq + 1) if hq % d == 0)})"
        )
    if (hkv >= size and hkv % size) or (hkv < size and size % hkv):
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} and {config.name}'s {hkv} KV heads: one must divide "
            "the other (KV heads are split, or replicated when fewer than the ranks)"
        )
    if config.intermediate_size % size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} does not divide the intermediate size "
            f"{config.intermediate_size}"
        )


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The shape one rank computes: its heads, its intermediate slice, its vocabulary rows."""
    check_tp_size(config, size)
    if size == 1:
        return config
    shard = -(-config.vocab_size // size)
    vocab = max(0, min(config.vocab_size, (rank + 1) * shard) - rank * shard)
    return config.replace(
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        vocab_size=vocab,
    )


def kv_heads_of_rank(config: ModelConfig, rank: int, size: int) -> range:
    """The global KV head ids rank `rank` holds (one replicated head when they are fewer)."""
    hkv = config.num_kv_heads
    if hkv >= size:
        per = hkv // size
        return range(rank * per, (rank + 1) * per)
    head = rank * hkv // size
    return range(head, head + 1)


def _rows(w: Linear, index: torch.Tensor) -> Linear:
    if isinstance(w, QuantizedWeight):
        mins = None if w.mins is None else w.mins[index].contiguous()
        return QuantizedWeight(
            w.format,
            (len(index), w.shape[1]),
            w.qweight[index].contiguous(),
            w.scales[index].contiguous(),
            mins,
            w.group_size,
        )
    return w[index].contiguous()


def _cols(w: Linear, start: int, stop: int, what: str) -> Linear:
    if not isinstance(w, QuantizedWeight):
        return w[:, start:stop].contiguous()
    shape = (w.shape[0], stop - start)
    if w.format == "int8":  # one scale per output row: unchanged by a column slice
        return QuantizedWeight("int8", shape, w.qweight[:, start:stop].contiguous(), w.scales)
    g = w.group_size
    if start % g or stop % g:
        raise TensorParallelConfigError(
            f"{what}: an int4 column shard [{start}, {stop}) does not fall on group boundaries "
            f"(group size {g}); use --quantization int8 or none with this tensor_parallel_size"
        )
    return QuantizedWeight(
        "int4",
        shape,
        w.qweight[:, start // 2 : stop // 2].contiguous(),
        w.scales[:, start // g : stop // g].contiguous(),
        w.mins[:, start // g : stop // g].contiguous(),
        g,
    )


def _bias(b: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if b is None else b[index].contiguous()


def shard_weights(weights: LlamaWeights, config: ModelConfig, rank: int, size: int) -> LlamaWeights:
    """Rank `rank`'s slice of every weight (the input is left untouched)."""
    check_tp_size(config, size)
    if size == 1:
        return weights
    d, hq, i = config.head_dim, config.num_heads // size, config.intermediate_size // size
    q = torch.arange(rank * hq * d, (rank + 1) * hq * d)
    kv = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv_heads_of_rank(config, rank, size)])
    qkv = torch.cat([q, config.q_size + kv, config.q_size + config.kv_size + kv])
    gate_up = torch.cat([torch.arange(rank * i, (rank + 1) * i)] * 2)
    gate_up[i:] += config.intermediate_size
    o_cols = (rank * hq * d, (rank + 1) * hq * d)
    down_cols = (rank * i, (rank + 1) * i)

    def layer(w: LayerWeights, n: int) -> LayerWeights:
        return LayerWeights(
            input_norm=w.input_norm,
            qkv=_rows(w.qkv, qkv),
            o=_cols(w.o, *o_cols, f"layer {n} o_proj"),
            post_norm=w.post_norm,
            gate_up=_rows(w.gate_up, gate_up),
            down=_cols(w.down, *down_cols, f"layer {n} down_proj"),
            qkv_bias=_bias(w.qkv_bias, qkv),
            o_bias=w.o_bias if rank == 0 else None,  # added once, before the all-reduce
            gate_up_bias=_bias(w.gate_up_bias, gate_up),
            down_bias=w.down_bias if rank == 0 else None,
            q_norm=w.q_norm,  # per head: every rank's heads take the same weights
            k_norm=w.k_norm,
            attn_out_norm=w.attn_out_norm,  # of the all-reduced output: whole on every rank
            mlp_out_norm=w.mlp_out_norm,
        )

    shard = -(-config.vocab_size // size)
    vocab = torch.arange(rank * shard, min(config.vocab_size, (rank + 1) * shard))
    if len(vocab) == 0:
        raise TensorParallelConfigError(f"vocabulary {config.vocab_size} too small for {size}")
    embed = _rows(weights.embed, vocab)
    head = embed if weights.tied else _rows(weights.lm_head, vocab)
    return LlamaWeights(
        embed,
        [layer(w, n) for n, w in enumerate(weights.layers)],
        weights.norm,
        head,
        weights.rope_freq_factors,
    )
