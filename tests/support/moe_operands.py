"""Random float MoE operands (x, router logits, w_gate_up, w_down) for the kernel tests, the
emulated ones on the CPU and the GPU ones on CUDA: the weights scaled by 1/sqrt(fan-in) so the
layer's outputs stay near unit size in every dtype."""

from __future__ import annotations

import torch

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def float_operands(tokens, experts, hidden, inter, dtype, seed=0, device="cpu") -> Operands:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    logits = torch.randn(tokens, experts, generator=g, device=device) * 2
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, device=device)
    w_down = torch.randn(experts, hidden, inter, generator=g, device=device)
    return x, logits, (w_gate_up * hidden**-0.5).to(dtype), (w_down * inter**-0.5).to(dtype)
