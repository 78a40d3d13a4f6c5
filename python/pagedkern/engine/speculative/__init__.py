"""Speculative decoding: cheap proposers guess the next k tokens, the target model verifies all
of them in one forward pass (reference/rejection_sampling.py holds the acceptance rule)."""

from .proposer import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
