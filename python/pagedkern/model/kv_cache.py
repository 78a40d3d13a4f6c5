"""The paged KV cache of one model: a single allocation
[num_slots, 2, num_blocks, num_kv_heads, block_size, head_dim] with per-layer (k, v) page views
in the layout the attention ops read ([num_blocks, Hkv, block_size, D], HND).

Usually every layer has its own slot and one block table serves them all. A hybrid model
(sliding-window layers beside full-attention ones: Gemma 2/3, Qwen2's max_window_layers) can
split its layers into *groups* of g layers each (KVLayerGroups), as vLLM's hybrid KV cache
manager does: every group has its own block table, and a block id spans g slots, so all groups
draw their blocks from one pool of equal-sized blocks. A sliding group only keeps the blocks
its window can reach, so at long context a 5:1 local:global model holds about a sixth of the
KV. g = the smaller kind's layer count; the larger kind fills ceil(n / g) groups (the last
one's unused slots are the price of one block size)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.cpu import huge_pages
from .config import SLIDING, ModelConfig

FP8 = torch.float8_e4m3fn
# auto: the model's activation dtype, except float32 activations on the CPU: float16 (half the
# bytes, and attention at depth reads the cache, as llama.cpp's default f16 cache)
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32")


def kv_element(kv_cache_dtype: str, activations: torch.dtype, device_type: str) -> torch.dtype:
    """The cache element of a kv_cache_dtype for a model of these activations on this device
    type. A 16-bit cache holds float32 activations' K/V rounded (to nearest even) or 16-bit
    activations' own; a float32 cache holds float32 activations only."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        on_cpu_fp32 = device_type == "cpu" and activations == torch.float32
        return torch.float16 if on_cpu_fp32 else activations
    if kv_cache_dtype == "fp8":
        return FP8
    element = getattr(torch, kv_cache_dtype)
    if activations not in (torch.float32, element):
        holds = (
            "a float32 cache holds float32 activations only"
            if element == torch.float32
            else "a 16-bit cache holds float32 activations or its own dtype's"
        )
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} with {activations} activations: {holds} (use auto)"
        )
    return element


@dataclass(frozen=True, slots=True)
class KVLayerGroups:
    """Which block table (group) and which cache slot each layer uses; group 0 is always a
    full-attention group. windows: per group, the sliding window of its layers (None: full)."""

    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    windows: tuple[int | None, ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks (over all groups) a sequence of num_tokens holds at most (blocks_held)."""
        return blocks_held(self.windows, num_tokens, block_size, chunk)


def blocks_held(
    windows: tuple[int | None, ...], num_tokens: int, block_size: int, chunk: int
) -> int:
    """Blocks a sequence of num_tokens holds at most over groups of these windows (None: full
    attention), fed at most `chunk` new tokens per step: a sliding group's table reaches back
    one window from the step's first query (it is released up to there after each step)."""
    full = -(-num_tokens // block_size)
    total = 0
    for window in windows:
        reach = full if window is None else (window + chunk - 2) // block_size + 2
        total += min(full, reach)
    return total


def kv_layer_groups(config: ModelConfig) -> KVLayerGroups | None:
    """The hybrid grouping of `config`'s layers, or None when every layer is of one kind (one
    group, one slot per layer: the plain layout)."""
    types = config.layer_types
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    full = [i for i, t in enumerate(types) if t != SLIDING]
    if not sliding or not full:
        return None
    g = min(len(sliding), len(full))
    group, slot = [0] * config.num_layers, [0] * config.num_layers
    windows: list[int | None] = []
    for layers, window in ((full, None), (sliding, config.sliding_window)):
        first = len(windows)
        for n, layer in enumerate(layers):
            group[layer], slot[layer] = first + n // g, n % g
        windows += [window] * -(-len(layers) // g)
    return KVLayerGroups(tuple(group), tuple(slot), tuple(windows))


@dataclass(slots=True)
class KVCache:
    """data: the whole cache; layers[i] = (k_cache, v_cache) views of layer i. Token t of a
    sequence lives in block block_table[t // block_size] at offset t % block_size, i.e. in
    slot block * block_size + offset (the slot_mapping of AttentionMetadata)."""

    data: torch.Tensor
    # fp8 caches: per layer (k_scale, v_scale); stored value = k / k_scale (E4M3, saturated).
    scales: list[tuple[float, float]] | None = None
    # hybrid models: per-kind block tables (module docstring); None: one slot per layer
    groups: KVLayerGroups | None = None
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)

    def __post_init__(self):
        if self.data.dim() != 6 or self.data.shape[1] != 2:
            raise ValueError(
                f"KV cache must be [L, 2, N, Hkv, bs, D], got {tuple(self.data.shape)}"
            )
        slots = [(layer[0], layer[1]) for layer in self.data.unbind(0)]
        if self.groups is None:
            self.layers = slots
        elif self.groups.num_slots != len(slots):
            raise ValueError(f"KV cache has {len(slots)} slots, its groups use {self.groups}")
        else:
            self.layers = [slots[s] for s in self.groups.layer_slot]
        if self.is_fp8 and (self.scales is None or len(self.scales) != self.num_layers):
            raise ValueError("an fp8 KV cache needs (k_scale, v_scale) for every layer")

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == FP8

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def block_size(self) -> int:
        return self.data.shape[4]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def kv_block_bytes(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    groups: KVLayerGroups | None = None,
) -> int:
    """Bytes one block takes over all layers (K and V), or over one group's slots."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    slots = config.num_layers if groups is None else groups.num_slots
    return slots * 2 * config.num_kv_heads * block_size * config.head_dim * itemsize


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
    groups: KVLayerGroups | None = None,
) -> KVCache:
    """A zeroed cache of `num_blocks` blocks of `block_size` tokens (zeros, so a stray read of an
    unwritten slot gives finite numbers, never NaN); fp8 (dtype FP8) needs per-layer scales;
    `groups`: per-kind block tables (one slot per group member)."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
    shape = (
        config.num_layers if groups is None else groups.num_slots,
        2,
        num_blocks,
        config.num_kv_heads,
        block_size,
        config.head_dim,
    )
    if torch.device(device).type == "cpu":  # read in page-sized runs: huge pages spare the TLB
        data = huge_pages.zeros(shape, dtype)
    else:
        data = torch.zeros(shape, dtype=dtype, device=device)
    return KVCache(data, scales, groups)
