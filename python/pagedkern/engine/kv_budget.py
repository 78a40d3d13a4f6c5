"""How many KV blocks the engine gets.

On the GPU, as vLLM does: run one forward pass of the largest batch the scheduler can form
(max_num_batched_tokens tokens) to measure the peak memory of weights plus activations, then give
the KV cache what is left of `gpu_memory_fraction` of the device's total memory. On the CPU: a
fixed budget, kv_cache_gib.
"""

from __future__ import annotations

import torch

from ..model import LlamaModel, SequenceChunk, build_batch, kv_block_bytes
from .config import EngineConfig


def profile_peak_bytes(
    model: LlamaModel, num_tokens: int, block_size: int, max_num_seqs: int
) -> int:
    """Peak bytes allocated by torch during a num_tokens-token prefill (the KV cache it needs
    excluded), plus the fp32 logits of max_num_seqs rows the sampler may hold."""
    device = model.device
    blocks = -(-num_tokens // block_size)
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
    model: LlamaModel, config: EngineConfig, max_model_len: int, draft: LlamaModel | None = None
) -> int:
    """Blocks of the target's cache, and of the draft model's beside it (as many blocks, over
    the same block tables), that the budget holds together."""
    cfg, bs, dtype = model.config, config.block_size, model.kv_dtype
    block_bytes = kv_block_bytes(cfg, bs, dtype)
    if draft is not None:
        block_bytes += kv_block_bytes(draft.config, bs, draft.kv_dtype)
    if model.device.type == "cuda":
        _, total = torch.cuda.mem_get_info(model.device)
        tokens = min(config.max_num_batched_tokens, max_model_len)
        peak = profile_peak_bytes(model, tokens, bs, config.max_num_seqs)
        budget = int(total * config.gpu_memory_fraction) - peak
    else:
        budget = int(config.kv_cache_gib * 2**30)
    blocks = max(budget, 0) // block_bytes
    if blocks < 1:
        raise RuntimeError(
            f"no memory for even one KV block ({block_bytes} bytes, budget {budget})"
        )
    return blocks
