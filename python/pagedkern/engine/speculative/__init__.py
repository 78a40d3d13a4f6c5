"""Speculative decoding: cheap proposers guess the next k tokens, the target model verifies all
of them in one forward pass (reference/rejection_sampling.py holds the acceptance rule)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .proposer import Proposal, Proposer

if TYPE_CHECKING:
    from ...model import KVCache, LlamaModel
    from ..config import EngineConfig

__all__ = ["Proposal", "Proposer", "make_proposer"]


def make_proposer(
    config: EngineConfig, target: LlamaModel, target_kv_cache: KVCache
) -> Proposer | None:
    """The proposer `config.speculative` names (None for "none"). The draft-model proposer is
    imported only when asked for (it loads a second model)."""
    if config.speculative == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative == "draft":
        from .draft import DraftProposer

        return DraftProposer.create(config.draft_model, target, target_kv_cache, config)
    return None
