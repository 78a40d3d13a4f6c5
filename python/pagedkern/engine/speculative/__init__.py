"""Speculative decoding: cheap proposers guess the next k tokens, the target model verifies all
of them in one forward pass (reference/rejection_sampling.py holds the acceptance rule)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .proposer import Proposal, Proposer

if TYPE_CHECKING:
    from ...model import KVCache, LlamaModel
    from ..config import EngineConfig

__all__ = ["Proposal", "Proposer", "load_draft", "make_proposer"]
Draft = tuple["LlamaModel", "LlamaModel | None"]  # DraftProposer.load: (model, its head's owner)


def load_draft(config: EngineConfig, target: LlamaModel) -> Draft | None:
    """The draft model `config` asks for (speculative "draft"), else None; loaded before the KV
    cache is sized, so the budget holds its cache too. The draft-model proposer is imported
    only when asked for."""
    if config.speculative != "draft":
        return None
    from .draft import DraftProposer

    return DraftProposer.load(config.draft_model, target, config)


def make_proposer(
    config: EngineConfig, target_kv_cache: KVCache, draft: Draft | None
) -> Proposer | None:
    """The proposer `config.speculative` names (None for "none"); "draft" over `draft`, what
    load_draft returned."""
    if config.speculative == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative == "draft":
        from .draft import DraftProposer

        return DraftProposer.over_cache(*draft, target_kv_cache, config)
    return None
