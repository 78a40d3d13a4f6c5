"""What the engine does at start-up when a CUDA kernel does not cover its configuration.

The ops' kernel-support decisions (pagedkern/ops/support.py) for the model's dtype, head dim and
vocabulary and the cache's block size are consulted once, before any CUDA graph is captured:

- backend "cuda" (strict): any op without a kernel is an error, raised here with the op and the
  reason, instead of at the first forward pass.
- backend "auto": each such op is reported (RuntimeWarning, once) and runs the PyTorch reference.
  If it is one of a decode step's ops, the decode CUDA graphs are turned off (the reference reads
  lengths back to the host, which capture forbids): a warning by default, an error if
  cuda_graphs=True was asked for explicitly.
- backend "reference", or a model on the CPU (backends "cpu" and "auto" there run the CPU
  backend, ops/cpu/): nothing to decide (the CPU still honours an explicit cuda_graphs=True,
  which runs the static-buffer path eagerly for tests). Backend "cpu" with a model on a GPU is
  an error.

Piecewise graphs of mixed steps (engine/piecewise_graphs.py) capture the same ops outside
attention, so they follow the decode graphs: on wherever those are, unless turned off.

`pick_device` chooses the engine's device for a backend; `step_graphs` makes the whole
decision for an engine (tensor parallelism and shadow mode run every step eagerly).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from .._extension import cuda_available, cuda_unavailable_reason
from ..ops import launch, support

if TYPE_CHECKING:
    from ..model import LlamaModel
    from .config import EngineConfig


def pick_device(backend: str) -> torch.device:
    """The device a backend runs on; "cuda" without a usable GPU is an error that says why."""
    if backend == "cpu":
        return torch.device("cpu")
    gpu = torch.cuda.is_available()
    if backend == "cuda" and not (gpu and cuda_available()):
        reason = cuda_unavailable_reason() or "torch sees no CUDA device"
        raise RuntimeError(f"--backend cuda needs a GPU and the kernels: {reason}")
    if backend == "auto" and gpu and not cuda_available():
        return torch.device("cpu")  # a GPU without our kernels: stay on the CPU reference
    return torch.device("cuda" if gpu else "cpu")


def _describe(missing: dict[str, str]) -> str:
    return "; ".join(f"{op} ({reason})" for op, reason in missing.items())


def decode_graphs(
    *,
    device_type: str,
    backend: str,
    dtype: str,
    head_dim: int,
    block_size: int,
    vocab: int,
    requested: bool | None,
    kv_cache_dtype: str = "auto",
    attention: dict | None = None,
    moe: bool = False,
) -> bool:
    """Whether to capture decode CUDA graphs; raises ValueError where the configuration cannot
    run as asked (see the module docstring). attention: the attention options the model's
    layers use (ModelConfig.attention_options), which no kernel has yet."""
    on_gpu = device_type == "cuda"
    if backend == "cuda" and not on_gpu:
        raise ValueError(
            f"backend 'cuda' runs the CUDA kernels only, but the model is on {device_type}"
        )
    if backend == "cpu" and on_gpu:
        raise ValueError("backend 'cpu' runs on the CPU only, but the model is on cuda")
    if not on_gpu or backend == "reference":
        if on_gpu and requested:
            raise ValueError(
                "cuda_graphs=True needs the CUDA kernels: the reference backend reads lengths "
                "back to the host, which CUDA-graph capture forbids"
            )
        return bool(requested)
    kv_dtype = {"auto": None, "fp8": support.FP8_KV_DTYPE}.get(kv_cache_dtype, kv_cache_dtype)
    decisions = support.model_support(dtype, head_dim, block_size, vocab, kv_dtype, attention, moe)
    missing = {op: d.reason for op, d in decisions.items() if not d.supported}
    if backend == "cuda" and missing:
        raise ValueError(
            f"backend 'cuda': no CUDA kernel for {_describe(missing)}; change the model dtype or "
            "block size, or use backend 'auto' to run these ops on the PyTorch reference "
            "(slower, without CUDA graphs)"
        )
    for op, reason in missing.items():
        launch.warn_fallback(op, reason, stacklevel=4)
    in_graph = {op: r for op, r in missing.items() if op in support.DECODE_GRAPH_OPS}
    if not in_graph:
        return True if requested is None else requested
    if requested:
        raise ValueError(
            f"cuda_graphs=True, but decode steps cannot be captured: {_describe(in_graph)} "
            "run on the PyTorch reference, which reads lengths back to the host"
        )
    if requested is None:
        warnings.warn(
            f"pagedkern: CUDA graphs are off because {_describe(in_graph)} run on the PyTorch "
            "reference (not capturable); decode runs eagerly and slowly",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def piecewise_graphs(*, decode_graphs: bool, requested: bool | None) -> bool:
    """Whether mixed (prefill + decode) steps replay piecewise graphs: by default exactly where
    decode graphs are on (CUDA kernels, TP = 1, or the CPU's explicit static-path test mode)."""
    if requested and not decode_graphs:
        raise ValueError(
            "piecewise_cuda_graphs=True needs decode CUDA graphs (cuda_graphs on, the CUDA "
            "kernels, tensor_parallel_size 1): the pieces capture the same ops"
        )
    return decode_graphs if requested is None else requested


def quantized_experts_support(model: LlamaModel) -> support.KernelSupport | None:
    """The quantized-experts MoE kernel's decision for the model's stacked quantized experts
    (csrc/moe_gemm_quant.cu; outside it ops.fused_moe runs a host loop that reads the expert
    counts back, which capture forbids), None where the experts are float."""
    from ..model.quantized_linear import QuantizedWeight

    layer = next(
        (x for x in model.weights.layers if isinstance(x.experts_gate_up, QuantizedWeight)), None
    )
    if layer is None:
        return None
    cfg, w = model.config, layer.experts_gate_up
    activation = "clamped_swiglu" if cfg.swiglu_limit is not None else cfg.hidden_act
    decision = support.fused_moe_quantized(
        str(model.dtype).removeprefix("torch."), w.shape[0], w.format, w.group_size,
        w.shape[2], w.shape[1] // 2, activation,
    )  # fmt: skip
    if decision.supported and (
        layer.experts_gate_up_bias is not None or cfg.moe_scoring == "softmax_topk"
    ):
        return support.KernelSupport(False, "gpt-oss's biases or routing")
    return decision


def step_graphs(model: LlamaModel, config: EngineConfig, shadowed: bool) -> tuple[bool, bool]:
    """(decode graphs, piecewise graphs) for an engine: on by default where the kernels run on
    a GPU, refused or off (with a warning) where a kernel does not cover this model and cache;
    off under tensor parallelism (its steps broadcast and all-reduce) and in shadow mode
    (every op call is checked on the host)."""
    graphs = decode_graphs(
        device_type=model.device.type,
        backend=config.backend,
        dtype=str(model.dtype).removeprefix("torch."),
        head_dim=model.config.head_dim,
        block_size=config.block_size,
        vocab=model.config.vocab_size,
        requested=config.cuda_graphs,
        kv_cache_dtype=model.kv_cache_dtype,
        attention=model.config.attention_options(),
        moe=bool(model.config.num_experts),
    )
    graphs = graphs and model.tp.size == 1 and not shadowed
    experts = quantized_experts_support(model)
    if graphs and model.device.type == "cuda" and experts is not None and not experts.supported:
        reason = f"quantized experts run fused_moe's host path ({experts.reason})"
        if config.cuda_graphs:
            raise ValueError(f"cuda_graphs=True, but decode steps cannot be captured: {reason}")
        warnings.warn(f"pagedkern: CUDA graphs are off: {reason}", RuntimeWarning, stacklevel=2)
        graphs = False
    if graphs and model.config.num_experts and model.device.type != "cuda":
        # the CPU's static-path test mode (on a GPU the support table above decided): MoE
        # layers run ops.fused_moe's reference, which reads expert counts back to the host
        reason = "ops.fused_moe runs on the PyTorch reference (not capturable)"
        raise ValueError(f"cuda_graphs=True, but decode steps cannot be captured: {reason}")
    return graphs, piecewise_graphs(decode_graphs=graphs, requested=config.piecewise_cuda_graphs)
