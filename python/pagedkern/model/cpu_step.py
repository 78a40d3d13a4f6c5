"""The CPU backend's share of a model's step: the op table the step's calls go to (ops/cpu/'s
functions where `ops.cpu.direct` says so, the step's positions and slots checked here
once), the fused layer tail and the one-call decoder where they run, and the decode rows' K/V
copies kept between steps. LlamaModel holds one on the CPU; its forward is one for every
backend."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import torch

from .. import ops
from ..ops import cpu as cpu_ops
from ..ops.cpu.decode_attention import DecodeCopies
from ..ops.cpu.decoder import CpuDecoder
from ..ops.cpu.direct import direct_cpu_calls
from ..ops.cpu.layer_tail import LayerTail
from ..ops.index_checks import check_rope_indices
from .attention_metadata import AttentionMetadata
from .config import ModelConfig
from .kv_cache import KVCache

_CPU = torch.device("cpu")


class CpuStep:
    """One model's, for `config` (the shape this rank computes) on `tp_size` ranks."""

    def __init__(self, config: ModelConfig, tp_size: int):
        self.decode_copies = DecodeCopies()  # StepAttention's (cpu_attention:tiles)
        self.tail: LayerTail | None = None  # one rank: a plain layer's tail in one C++ call
        if tp_size == 1:
            routing = None  # (MoE layers: as model/moe.py routes; gpt-oss's runs the ops)
            if config.num_experts > 0 and config.swiglu_limit is None:
                routing = (config.num_experts_per_tok, config.norm_topk_prob, config.moe_scoring)
            self.tail = LayerTail(
                config.hidden_size,
                config.intermediate_size,
                config.q_size,
                config.hidden_act,
                config.rms_norm_eps,
                routing,
            )
        # ... and every plain layer of a step in one C++ call (ops/cpu/decoder.py)
        self.decoder = None if self.tail is None else CpuDecoder(config)

    def ops_for(
        self, meta: AttentionMetadata, kv_cache: KVCache, max_positions: int
    ) -> tuple[ModuleType | SimpleNamespace, LayerTail | None]:
        """(the step's op table, the tail for its layers or None). On the CPU backend (CPU
        tensors under "cpu" or "auto"; not in shadow mode, whose wrappers replace
        `pagedkern.ops` entries) ops/cpu/'s functions themselves; else `pagedkern.ops`."""
        if not direct_cpu_calls(_CPU):
            return ops, None
        tail = None if self.tail is None else self.tail.for_step()
        slots = kv_cache.data.shape[2] * kv_cache.block_size
        check_rope_indices(meta.positions, meta.slot_mapping, max_positions, slots)
        cpu_ops.rope.begin_step()  # its layers share the step's RoPE rows and slots
        return cpu_ops.step_implementations(), tail
