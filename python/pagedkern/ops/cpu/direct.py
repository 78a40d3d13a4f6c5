"""Whether a step's calls go straight to the CPU backend's functions (the step's op table,
model/cpu_step.py; the runner's sampling) instead of through `pagedkern.ops`, whose checks
then run once a step rather than at every call."""

from __future__ import annotations

import torch

from ..launch import on_cpu_backend
from ..shadow import shadowing


def direct_cpu_calls(device: torch.device) -> bool:
    """Whether a step's calls on `device` may go straight to ops.cpu's functions, the caller
    vouching for its arguments (the engine's and the model's own tensors): CPU tensors under the
    "cpu" or "auto" backend, and not in shadow mode, whose wrappers replace `pagedkern.ops`
    entries."""
    return on_cpu_backend(device) and not shadowing()
