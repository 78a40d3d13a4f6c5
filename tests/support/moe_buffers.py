"""The MoE kernels' buffers poisoned for the emulated tests: every buffer ops.moe allocates
(ops.moe.routed_buffers serves the float and the quantized fused_moe) starts as NaN, or -7 for
integer arrays, so a row a kernel fails to write cannot pass."""

from __future__ import annotations

from pagedkern.ops import moe


def poison_moe_buffers(monkeypatch) -> None:
    real = moe.empty_like

    def poisoned(a, shape, dtype=None, name="out"):
        out = real(a, shape, dtype, name)
        out.fill_(-7 if str(out.dtype).startswith("torch.int") else float("nan"))
        return out

    monkeypatch.setattr(moe, "empty_like", poisoned)
