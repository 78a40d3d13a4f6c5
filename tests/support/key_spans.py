"""The key span of every GEMM the CPU backend's attention runs: what keeps a row's bits
independent of its chunk on any BLAS is that each scores GEMM spans, and each weighted sum
reduces over, exactly one whole key tile (ops/cpu/attention.py)."""

from __future__ import annotations

import torch


def record_key_spans(monkeypatch, head_dim: int) -> list[int]:
    """From now on (monkeypatch's scope), the keys of each torch.bmm: scores are
    q [B, M, head_dim] @ keys [B, head_dim, T], weighted sums p [B, M, T] @ values [B, T, D]."""
    spans: list[int] = []
    real_bmm = torch.bmm

    def bmm(a, b, **kwargs):
        spans.append(b.shape[2] if a.shape[2] == head_dim else a.shape[2])
        return real_bmm(a, b, **kwargs)

    monkeypatch.setattr(torch, "bmm", bmm)
    return spans
