"""The scheduler's limits, derived from the engine's configuration and the model's: the token
budget and sequence limit, the context, speculation's lookahead, and the sliding windows whose
older KV blocks are released."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.config import SLIDING, ModelConfig
from .config import EngineConfig

_ENGINE_DEFAULTS = EngineConfig()


def released_kv_window(model_config: ModelConfig, config: EngineConfig) -> int | None:
    """The window whose older blocks the scheduler releases: the model's sliding window when
    every layer has one (Mistral-style). None when some layer attends to every key (Gemma 2/3's
    global layers, Qwen2's layers past max_window_layers: they still read every block, and the
    layers share one block table), and under draft-model speculation (the draft model reads
    the same tables, with no window)."""
    types = model_config.layer_types
    if not types or any(t != SLIDING for t in types) or config.speculative == "draft":
        return None
    return model_config.sliding_window


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's limits; the defaults are EngineConfig's (`from_engine` builds one).
    max_model_len: the context a sequence may fill (the model's, capped by the KV cache)."""

    max_model_len: int
    max_num_seqs: int = _ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _ENGINE_DEFAULTS.max_num_batched_tokens
    enable_chunked_prefill: bool = _ENGINE_DEFAULTS.enable_chunked_prefill
    num_lookahead_tokens: int = 0  # k of speculative decoding (0: off)
    # Every layer's sliding window (None: some layer attends to everything): blocks wholly
    # older than any future query's window are released (BlockTables.release_outside_window).
    kv_window: int | None = None
    # Hybrid local/global models with per-kind tables (engine/hybrid_tables.py): the windows
    # of layer groups 1.. (None: full attention; group 0 is full). (): one table.
    group_windows: tuple[int | None, ...] = ()
    # Whether the engine may copy K/V from block to block (an n > 1 fork's partial last
    # prompt block): not under tensor parallelism, whose workers' cache shards only a step's
    # forward writes. Without it a sample whose leader's prompt ends inside a block recomputes
    # its prompt (prefix-cache hits make that cheap).
    copy_blocks: bool = True

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")
        if not self.enable_chunked_prefill and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill max_model_len ({self.max_model_len}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}): a longer sequence "
                "could never be scheduled again after a preemption"
            )

    @classmethod
    def from_engine(
        cls,
        config: EngineConfig,
        max_model_len: int,
        kv_window: int | None = None,
        group_windows: tuple[int | None, ...] = (),
    ) -> SchedulerConfig:
        return cls(
            kv_window=kv_window,
            group_windows=group_windows,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=(
                config.num_speculative_tokens if config.speculative != "none" else 0
            ),
            copy_blocks=config.tensor_parallel_size == 1,
        )
