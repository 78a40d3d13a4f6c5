"""How many KV blocks the engine gets, and giving its memory back.

On the GPU, as vLLM does: run one forward pass of the largest batch the scheduler can form
(max_num_batched_tokens tokens) to measure the peak memory of weights plus activations, then give
the KV cache what is left of `gpu_memory_fraction` of the device's total memory, and never more
than the device can really hand out now (`kv_budget_bytes`). On the CPU: a fixed budget,
kv_cache_gib.

What can really be allocated: the driver's free memory, plus what PyTorch's caching allocator
holds reserved but unused. The two are not alike. The cache is one allocation of many GiB; the
caching allocator can serve it only from memory the driver gives (its cached blocks are pieces
of earlier segments, possibly split around live tensors, as when a closed engine's freed cache
was carved up by the next model's weights). The cached blocks do serve a step's activations,
which are many small allocations. So the KV cache gets at most the driver's free memory less
the activations the cached blocks cannot hold. Reading the memory first collects garbage and
empties the cache, so memory an engine dropped counts as free.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch

from ..model import KVLayerGroups, LlamaModel, SequenceChunk, build_batch, kv_block_bytes
from .config import EngineConfig

GIB = 2**30


class KVCacheMemoryError(RuntimeError):
    """The KV cache could not be allocated (the message names the sizes)."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One reading of a CUDA device's memory, in bytes."""

    free: int  # what the driver can still hand out (cudaMemGetInfo)
    total: int
    reserved: int  # held by PyTorch's caching allocator in this process
    allocated: int  # of `reserved`, in live tensors

    @property
    def cached(self) -> int:
        """Reserved by the caching allocator but unused (it cannot be given back)."""
        return max(self.reserved - self.allocated, 0)

    def describe(self) -> str:
        return (
            f"{_gib(self.free)} free of {_gib(self.total)}, {_gib(self.allocated)} in PyTorch "
            f"tensors, {_gib(self.cached)} reserved by PyTorch's caching allocator but unused"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def read_memory(device: torch.device) -> DeviceMemory:
    """The device's memory once garbage is collected and the caching allocator has given back
    every whole segment it does not use (an engine dropped but not yet collected counts free)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        free=int(free),
        total=int(total),
        reserved=int(torch.cuda.memory_reserved(device)),
        allocated=int(torch.cuda.memory_allocated(device)),
    )


def kv_budget_bytes(memory: DeviceMemory, peak: int, fraction: float) -> int:
    """Bytes the KV cache may take, given `memory` read after the profiling pass and `peak`,
    the most PyTorch had allocated during it (the profile's own cache excluded): the process's
    live tensors (this model's weights, anything else alive) plus a step's activations.

    - `fraction` of the device for this process: total x fraction - peak;
    - what the device can hand out for one allocation: the driver's free memory, less the
      activations (peak - allocated now) that the caching allocator's unused blocks cannot
      hold (module docstring).
    The smaller of the two (negative: nothing fits)."""
    by_fraction = int(memory.total * fraction) - peak
    activations = max(peak - memory.allocated, 0)
    by_free = memory.free - max(activations - memory.cached, 0)
    return min(by_fraction, by_free)


def profile_peak_bytes(
    model: LlamaModel, num_tokens: int, block_size: int, max_num_seqs: int
) -> int:
    """Peak bytes allocated by torch during a num_tokens-token prefill (the KV cache it needs
    excluded), plus the fp32 logits of max_num_seqs rows the sampler may hold."""
    device = model.device
    blocks = -(-num_tokens // block_size)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    kv = model.allocate_kv_cache(blocks, block_size)
    kv_bytes = kv.data.numel() * kv.data.element_size()
    chunk = SequenceChunk([0] * num_tokens, 0, list(range(blocks)))
    input_ids, meta = build_batch([chunk], block_size, device)
    model(input_ids, meta, kv)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes
    del kv, input_ids, meta
    torch.cuda.empty_cache()
    return peak + max_num_seqs * model.config.vocab_size * 4


def kv_cache_blocks(
    model: LlamaModel,
    config: EngineConfig,
    max_model_len: int,
    draft: LlamaModel | None = None,
    groups: KVLayerGroups | None = None,
) -> int:
    """Blocks of the target's cache, and of the draft model's beside it (as many blocks, over
    the same block tables), that the budget holds together; `groups`: per-kind tables, whose
    blocks span one group's layers (more, smaller blocks: model/kv_cache.py)."""
    cfg, bs, dtype = model.config, config.block_size, model.kv_dtype
    block_bytes = kv_block_bytes(cfg, bs, dtype, groups)
    if draft is not None:
        block_bytes += kv_block_bytes(draft.config, bs, draft.kv_dtype)
    where = ""
    if model.device.type == "cuda":
        tokens = min(config.max_num_batched_tokens, max_model_len)
        peak = profile_peak_bytes(model, tokens, bs, config.max_num_seqs)
        memory = read_memory(model.device)
        budget = kv_budget_bytes(memory, peak, config.gpu_memory_fraction)
        where = (
            f" on {model.device}: gpu_memory_fraction {config.gpu_memory_fraction} of "
            f"{_gib(memory.total)}, a step's peak {_gib(peak)}; {memory.describe()}"
        )
    else:
        budget = int(config.kv_cache_gib * GIB)
    blocks = max(budget, 0) // block_bytes
    if blocks < 1:
        raise KVCacheMemoryError(
            f"no memory for even one KV block ({block_bytes} bytes, budget {budget} bytes){where}"
        )
    return blocks


def context_that_fits(
    groups: KVLayerGroups, capacity: int, block_size: int, chunk: int, context: int
) -> int:
    """The longest sequence (at most `context` tokens) whose blocks over every group fit in
    `capacity` blocks, prefilled `chunk` tokens per step (two steps in flight: as
    engine/hybrid_tables.py bounds it); 0 if none does."""
    lo, hi = 0, context
    while lo < hi:  # blocks_for grows with the length
        mid = (lo + hi + 1) // 2
        if groups.blocks_for(mid, block_size, 2 * chunk) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def allocate_kv_cache(
    model: LlamaModel, num_blocks: int, block_size: int, groups: KVLayerGroups | None = None
):
    """model.allocate_kv_cache, with a refusal of the device reported as a KVCacheMemoryError
    that names the sizes (requested, free, reserved) instead of an out-of-memory traceback."""
    try:
        if groups is None:
            return model.allocate_kv_cache(num_blocks, block_size)
        return model.allocate_kv_cache(num_blocks, block_size, groups)
    except torch.cuda.OutOfMemoryError:
        pass  # outside the handler: the error below does not chain the allocator's traceback
    want = num_blocks * kv_block_bytes(model.config, block_size, model.kv_dtype, groups)
    memory = read_memory(model.device)
    raise KVCacheMemoryError(
        f"the KV cache of {num_blocks} blocks x {block_size} tokens ({_gib(want)}) does not fit "
        f"on {model.device}: {memory.describe()}. Close engines no longer used (LLM.close(), "
        "Engine.close()), or lower gpu_memory_fraction or num_blocks"
    )


def _free(tensor) -> None:
    """Give a tensor's memory back now, whoever still holds the tensor (it is empty after)."""
    if isinstance(tensor, torch.Tensor):
        # a storage that is not resizable (from_blob, DLPack) is left alone
        with contextlib.suppress(RuntimeError):
            tensor.untyped_storage().resize_(0)


def _weight_tensors(weights) -> list:
    """Every tensor of a model's weights (LlamaWeights and its layers, quantized ones too)."""
    found, stack = [], [weights]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dataclass_fields__"):
            stack.extend(getattr(obj, name, None) for name in obj.__dataclass_fields__)
    return found


def release_device_memory(kv_caches, models=(), graphs=None) -> None:
    """Free an engine's device memory when it closes: its KV caches, the weights of the models
    it loaded (`models`) and its decode CUDA graphs, then hand the caching allocator's unused
    segments back to the driver, so that an engine created next in the same process finds the
    memory free, even if something (a reference cycle, a traceback) still holds the old one."""
    device = None
    for kv in kv_caches:
        if kv is not None:
            device = device or kv.data.device
            _free(kv.data)
    for model in models:
        device = device or model.device
        for t in _weight_tensors(model.weights):
            _free(t)
        _free(model.cos_sin)
    if graphs is not None:
        for graph in graphs._graphs.values():
            graph.reset()
        graphs._graphs.clear()
    if device is not None and device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
