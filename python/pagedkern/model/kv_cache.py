"""The paged KV cache of one model: a single allocation
[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim] with per-layer (k, v) page views
in the layout the attention ops read ([num_blocks, Hkv, block_size, D], HND)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig

FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's activation dtype


@dataclass(slots=True)
class KVCache:
    """data: the whole cache; layers[i] = (k_cache, v_cache) views of layer i. Token t of a
    sequence lives in block block_table[t // block_size] at offset t % block_size, i.e. in
    slot block * block_size + offset (the slot_mapping of AttentionMetadata)."""

    data: torch.Tensor
    # fp8 caches: per layer (k_scale, v_scale); stored value = k / k_scale (E4M3, saturated).
    scales: list[tuple[float, float]] | None = None
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)

    def __post_init__(self):
        if self.data.dim() != 6 or self.data.shape[1] != 2:
            raise ValueError(
                f"KV cache must be [L, 2, N, Hkv, bs, D], got {tuple(self.data.shape)}"
            )
        self.layers = [(layer[0], layer[1]) for layer in self.data.unbind(0)]
        if self.is_fp8 and (self.scales is None or len(self.scales) != self.num_layers):
            raise ValueError("an fp8 KV cache needs (k_scale, v_scale) for every layer")

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == FP8

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def block_size(self) -> int:
        return self.data.shape[4]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * block_size * config.head_dim * itemsize


def num_blocks_for_bytes(
    config: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    """How many blocks fit in `budget_bytes` (e.g. free GPU memory after the weights)."""
    return max(0, budget_bytes // kv_block_bytes(config, block_size, dtype))


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int = 16,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    scales: list[tuple[float, float]] | None = None,
) -> KVCache:
    """A zeroed cache of `num_blocks` blocks of `block_size` tokens (zeros, so a stray read of an
    unwritten slot gives finite numbers, never NaN); fp8 (dtype FP8) needs per-layer scales."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
    shape = (
        config.num_layers,
        2,
        num_blocks,
        config.num_kv_heads,
        block_size,
        config.head_dim,
    )
    return KVCache(torch.zeros(shape, dtype=dtype, device=device), scales)
