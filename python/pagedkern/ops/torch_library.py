"""pagedkern's ops as torch custom ops (`torch.ops.pagedkern.<name>`), so torch.compile traces
through a model built from them (no graph breaks under fullgraph=True) and torch's own op
checks (`torch.library.opcheck`) apply.

Importing this module registers them (it imports torch; `import pagedkern` alone does not, so
CuPy users never pay for it). Each registered op calls the same entry of `pagedkern.ops` that a
direct call reaches: validation, then the CUDA kernel on CUDA tensors or the PyTorch reference on
CPU tensors, on torch's current stream. Each has a schema saying what it mutates and a fake
implementation that gives its outputs' shapes without touching data.

Where the signatures differ from the direct ops, it is for torch's schema language: per-row
sampling parameters are tensors (no Python-number shortcut); attention returns `out` and a
`*_with_lse` twin returns (out, lse); `rejection_sample` takes `max_draft` (the widest
proposal) so its output shape never depends on data; `quant_linear` takes the quantized weight's
tensors and format instead of a QuantizedWeight.

The registered path costs torch's dispatcher on every call (bench/test_bench_torch_library.py
measures it against the direct call); the engine's own hot loop keeps calling `pagedkern.ops`
directly, as vLLM bypasses its custom-op wrappers for the same reason.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import (
    flash_prefill as _flash_prefill,
)
from . import (
    fused_add_rms_norm as _fused_add_rms_norm,
)
from . import (
    fused_moe as _fused_moe,
)
from . import (
    gelu_tanh_and_mul as _gelu_tanh_and_mul,
)
from . import (
    paged_attention as _paged_attention,
)
from . import (
    rejection_sample as _rejection_sample,
)
from . import (
    rms_norm as _rms_norm,
)
from . import (
    rope_and_cache as _rope_and_cache,
)
from . import (
    sample as _sample,
)
from . import (
    silu_and_mul as _silu_and_mul,
)

Tensor = torch.Tensor


# --- norms and activation ---------------------------------------------------------------------
@custom_op("pagedkern::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return _rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps=1e-6):
    return torch.empty_like(x)


@custom_op("pagedkern::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps=1e-6):
    return None


@custom_op("pagedkern::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    return _silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@custom_op("pagedkern::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    return _gelu_tanh_and_mul(x)


@gelu_tanh_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# --- RoPE and the KV cache --------------------------------------------------------------------
@custom_op("pagedkern::rope_and_cache", mutates_args=("q", "k", "k_cache", "v_cache"))
def rope_and_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    _rope_and_cache(
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip


@rope_and_cache.register_fake
def _(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


# --- attention --------------------------------------------------------------------------------
def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, k_scale, v_scale, lse):
    return _paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, None, lse, max_seq_len=max_seq_len,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


@custom_op("pagedkern::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
    max_seq_len: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> Tensor:
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, k_scale, v_scale)
    return _decode(*args, False)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale=None, max_seq_len=None, k_scale=None,
      v_scale=None):  # fmt: skip
    return torch.empty_like(q)


@custom_op("pagedkern::paged_attention_with_lse", mutates_args=())
def paged_attention_with_lse(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
    max_seq_len: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, k_scale, v_scale)
    return _decode(*args, True)


@paged_attention_with_lse.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale=None, max_seq_len=None, k_scale=None,
      v_scale=None):  # fmt: skip
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def _prefill(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, k_scale, v_scale,
             lse):  # fmt: skip
    return _flash_prefill(
        q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, None, lse,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


@custom_op("pagedkern::flash_prefill", mutates_args=())
def flash_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> Tensor:
    args = (q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, k_scale, v_scale)
    return _prefill(*args, False)


@flash_prefill.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale=None, k_scale=None,
      v_scale=None):  # fmt: skip
    return torch.empty_like(q)


@custom_op("pagedkern::flash_prefill_with_lse", mutates_args=())
def flash_prefill_with_lse(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    args = (q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale, k_scale, v_scale)
    return _prefill(*args, True)


@flash_prefill_with_lse.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, block_tables, seq_lens, scale=None, k_scale=None,
      v_scale=None):  # fmt: skip
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


# --- sampling ---------------------------------------------------------------------------------
@custom_op("pagedkern::sample", mutates_args=())
def sample(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    min_p: Tensor | None = None,
) -> Tensor:
    return _sample(logits, temperature, top_p, top_k, seeds, offsets, min_p=min_p)


@sample.register_fake
def _(logits, temperature, top_p, top_k, seeds, offsets, min_p=None):
    return logits.new_empty((logits.shape[0],), dtype=torch.int32)


@custom_op("pagedkern::sample_with_logprobs", mutates_args=())
def sample_with_logprobs(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    num_top: int,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(token ids, their logprobs, the num_top most likely ids and their logprobs)."""
    rows = logits.shape[0]
    logprobs = logits.new_empty((rows,), dtype=torch.float32)
    top_ids = logits.new_empty((rows, num_top), dtype=torch.int32)
    top_logprobs = logits.new_empty((rows, num_top), dtype=torch.float32)
    ids = _sample(
        logits, temperature, top_p, top_k, seeds, offsets, min_p=min_p, logprobs=logprobs,
        top_ids=top_ids, top_logprobs=top_logprobs,
    )  # fmt: skip
    return ids, logprobs, top_ids, top_logprobs


@sample_with_logprobs.register_fake
def _(logits, temperature, top_p, top_k, seeds, offsets, num_top, min_p=None):
    rows = logits.shape[0]
    return (
        logits.new_empty((rows,), dtype=torch.int32),
        logits.new_empty((rows,), dtype=torch.float32),
        logits.new_empty((rows, num_top), dtype=torch.int32),
        logits.new_empty((rows, num_top), dtype=torch.float32),
    )


@custom_op("pagedkern::rejection_sample", mutates_args=())
def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    cu_draft: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    max_draft: int,
) -> tuple[Tensor, Tensor]:
    """(token ids [B, max_draft + 1], -1 past each row's count; counts [B])."""
    batch = cu_draft.shape[0] - 1
    out_ids = target_probs.new_empty((batch, max_draft + 1), dtype=torch.int32)
    out_num = target_probs.new_empty((batch,), dtype=torch.int32)
    _rejection_sample(
        target_probs, draft_token_ids, draft_probs, cu_draft, seeds, offsets,
        out_token_ids=out_ids, out_num_tokens=out_num,
    )  # fmt: skip
    return out_ids, out_num


@rejection_sample.register_fake
def _(target_probs, draft_token_ids, draft_probs, cu_draft, seeds, offsets, max_draft):
    batch = cu_draft.shape[0] - 1
    return (
        target_probs.new_empty((batch, max_draft + 1), dtype=torch.int32),
        target_probs.new_empty((batch,), dtype=torch.int32),
    )


# --- weight-only quantized GEMM ---------------------------------------------------------------
@custom_op("pagedkern::quant_linear", mutates_args=())
def quant_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    mins: Tensor | None,
    weight_format: str,
    out_features: int,
    group_size: int = 0,
    bias: Tensor | None = None,
    input_index: Tensor | None = None,
) -> Tensor:
    """x [M, K] @ the quantized weight [out_features, K]^T (+ bias); weight_format int8 or int4,
    the tensors as model.quantized_linear.QuantizedWeight holds them (input_index: act-order's)."""
    from ..reference.quantized_weight import QuantizedWeight
    from .quant_gemm import quant_linear as direct

    weight = QuantizedWeight(
        weight_format, (out_features, x.shape[-1]), qweight, scales, mins, group_size,
        input_index=input_index,
    )  # fmt: skip
    return direct(x, weight, bias)


@quant_linear.register_fake
def _(
    x, qweight, scales, mins, weight_format, out_features, group_size=0, bias=None,
    input_index=None,
):  # fmt: skip
    return x.new_empty((x.shape[0], out_features))


# --- mixture of experts ----------------------------------------------------------------------
@custom_op("pagedkern::fused_moe", mutates_args=())
def fused_moe(
    hidden: Tensor,
    router_logits: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    top_k: int,
    renormalize: bool = True,
    activation: str = "silu",
) -> Tensor:
    return _fused_moe(
        hidden, router_logits, w_gate_up, w_down, top_k, renormalize=renormalize,
        activation=activation,
    )  # fmt: skip


@fused_moe.register_fake
def _(hidden, router_logits, w_gate_up, w_down, top_k, renormalize=True, activation="silu"):
    return torch.empty_like(hidden)


OPS = (
    rms_norm,
    fused_add_rms_norm,
    silu_and_mul,
    gelu_tanh_and_mul,
    rope_and_cache,
    paged_attention,
    paged_attention_with_lse,
    flash_prefill,
    flash_prefill_with_lse,
    sample,
    sample_with_logprobs,
    rejection_sample,
    quant_linear,
    fused_moe,
)
