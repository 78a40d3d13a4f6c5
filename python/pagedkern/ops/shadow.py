"""Shadow mode: every op call inside an engine's forward also runs its PyTorch reference on
copies of the same inputs and compares, per op and layer, so a kernel that goes wrong on a real
model is named (step, layer, op, row) instead of surfacing as odd text.

How it hooks in: while any shadowed forward runs, the op entries of `pagedkern.ops` (which the
model calls as `ops.<name>`) are replaced by wrappers; outside one they are the plain functions
again, so shadow mode costs nothing when off. A wrapper does nothing but call through unless
its thread is inside `ShadowReport.active()`. The model tags each layer with `enter_layer`.

What is compared (the op's output against reference(copies of its inputs)), with the relative
tolerance ||out - ref|| / ||ref|| of the kernels' tests: float32 1e-4, float16 2e-3,
bfloat16 1e-2 (fp8 KV caches: 6e-2, the E4M3 step; quant_linear at least 1e-2: its kernels
multiply bf16 activations). Outputs: rms_norm, silu_and_mul, gelu_tanh_and_mul,
quant_linear, paged_attention, flash_prefill, fused_moe (float or quantized experts, 4e-2
for the latter; and its routing, moe_route's ids exactly); fused_add_rms_norm's x and residual;
rope_and_cache's q, k and the K/V rows it wrote (the reference writes into a small cache of its
own, so the real cache is never copied whole). `sample` and `rejection_sample` draw from a
distribution (a kernel need not draw the same ids as the reference) and are not compared.

A divergence is a row over tolerance; the first one is kept (step, layer, op, row, error).
strict: the first divergence raises ShadowDivergence with the report.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

COMPARED = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "rope_and_cache",
    "paged_attention",
    "flash_prefill",
    "quant_linear",
    "fused_moe",
)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FP8_TOLERANCE = 6e-2
QUANTIZED_MOE_TOLERANCE = 4e-2  # two quantized GEMMs on bf16 activations (quant_linear: 1e-2)

_report: ContextVar[ShadowReport | None] = ContextVar("pagedkern_shadow", default=None)
_layer: ContextVar[int | None] = ContextVar("pagedkern_shadow_layer", default=None)
_lock = threading.Lock()
_installed = 0  # shadowed forwards running (the wrappers are in place while > 0)
_plain: dict[str, Callable] = {}  # op name -> the function the wrapper replaced


class ShadowDivergence(RuntimeError):
    """strict shadow mode: an op's output left its tolerance (the message is the report)."""


@dataclass(slots=True)
class OpLayerStats:
    calls: int = 0
    max_error: float = 0.0
    divergences: int = 0


@dataclass(frozen=True, slots=True)
class Divergence:
    step: int
    layer: int | None
    op: str
    row: int
    error: float
    tolerance: float

    def describe(self) -> str:
        layer = "-" if self.layer is None else self.layer
        return (
            f"step {self.step}, layer {layer}, {self.op}, row {self.row}: relative error "
            f"{self.error:.3g} > {self.tolerance:.3g}"
        )


class ShadowReport:
    """What one engine's shadow mode found: per (op, layer) calls, max relative error and
    divergences, and the first divergence."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.step = 0
        self.stats: dict[tuple[str, int | None], OpLayerStats] = {}
        self.first: Divergence | None = None

    @contextlib.contextmanager
    def active(self, step: int) -> Iterator[None]:
        """Shadow the op calls of this thread's block (one forward pass of step `step`)."""
        global _installed
        self.step = step
        with _lock:
            if _installed == 0:
                _install()
            _installed += 1
        token = _report.set(self)
        try:
            yield
        finally:
            _report.reset(token)
            _layer.set(None)
            with _lock:
                _installed -= 1
                if _installed == 0:
                    _uninstall()

    def record(self, op: str, outputs: list[tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """(output, reference, tolerance) pairs of one call: rows are the first dimension."""
        layer = _layer.get()
        stats = self.stats.setdefault((op, layer), OpLayerStats())
        stats.calls += 1
        for out, ref, tolerance in outputs:
            error, row = _relative_error(out, ref, tolerance)
            stats.max_error = max(stats.max_error, error)
            if row is None:
                continue
            stats.divergences += 1
            if self.first is None:
                self.first = Divergence(self.step, layer, op, row, error, tolerance)
                if self.strict:
                    raise ShadowDivergence(self.summary())

    def rows(self) -> list[list]:
        """[op, layer (-1: none), calls, max relative error, divergences] per op and layer,
        plain values (what the engine core sends its front end for /metrics)."""
        return [
            [op, -1 if layer is None else layer, s.calls, s.max_error, s.divergences]
            for (op, layer), s in sorted(
                self.stats.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)
            )
        ]

    def summary(self) -> str:
        """The report as text: the first divergence, then per op its calls and worst layer."""
        lines = ["shadow mode: every op checked against its PyTorch reference"]
        if self.first is None:
            lines.append("  no divergence")
        else:
            lines.append(f"  first divergence: {self.first.describe()}")
        by_op: dict[str, list[tuple[int | None, OpLayerStats]]] = {}
        for (op, layer), stats in self.stats.items():
            by_op.setdefault(op, []).append((layer, stats))
        for op, rows in sorted(by_op.items()):
            calls = sum(s.calls for _, s in rows)
            diverged = sum(s.divergences for _, s in rows)
            layer, worst = max(rows, key=lambda r: r[1].max_error)
            where = "" if layer is None else f" (layer {layer})"
            lines.append(
                f"  {op}: {calls} calls, max relative error {worst.max_error:.3g}{where}, "
                f"{diverged} divergent"
            )
        return "\n".join(lines)


def shadowing() -> bool:
    """Whether this thread's op calls are shadowed now (callers that bypass the `ops` entries,
    e.g. the model's planned attention, take them instead)."""
    return _report.get() is not None


def enter_layer(layer: int | None) -> None:
    """The model's layer loop: the op calls that follow belong to `layer` (a no-op unless a
    shadowed forward runs)."""
    if _installed:
        _layer.set(layer)


def _relative_error(
    out: torch.Tensor, ref: torch.Tensor, tolerance: float
) -> tuple[float, int | None]:
    """(||out - ref|| / ||ref|| over all elements, the first row whose own relative error
    exceeds the tolerance or that holds a NaN, else None)."""
    o = out.detach().to(torch.float64).reshape(out.shape[0], -1) if out.ndim else out.double()
    r = ref.detach().to(device=out.device, dtype=torch.float64).reshape(o.shape)
    if o.numel() == 0:
        return 0.0, None
    diff = (o - r).norm(dim=-1)
    scale = r.norm(dim=-1).clamp_min(1e-30)
    per_row = diff / scale
    bad = (per_row > tolerance) | torch.isnan(o).any(dim=-1)
    total = float((o - r).norm() / r.norm().clamp_min(1e-30))
    rows = torch.nonzero(bad)
    if rows.numel() == 0:
        return total, None
    row = int(rows[0, 0])
    return max(total, float(per_row[row])), row


def _tolerance(dtype: torch.dtype, fp8: bool = False) -> float:
    return FP8_TOLERANCE if fp8 else TOLERANCE.get(dtype, 1e-4)


def _bind(fn: Callable, args, kwargs) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _reference_kwargs(ref: Callable, arguments: dict) -> dict:
    """The arguments the reference takes (the ops' launch-only ones, e.g. stream, workspace,
    num_splits, dropped)."""
    accepted = inspect.signature(ref).parameters
    return {k: v for k, v in arguments.items() if k in accepted}


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def _shadow_call(name: str, fn: Callable, args, kwargs, report: ShadowReport):
    from .. import reference

    arguments = _bind(fn, args, kwargs)
    if name == "rope_and_cache":
        return _shadow_rope(fn, args, kwargs, arguments, report)
    if name == "fused_moe":
        return _shadow_moe(fn, args, kwargs, arguments, report)
    if name == "fused_add_rms_norm":
        x0, r0 = arguments["x"].clone(), arguments["residual"].clone()
        result = fn(*args, **kwargs)
        want_x, want_r = reference.fused_add_rms_norm(x0, r0, arguments["weight"], arguments["eps"])
        tol = _tolerance(want_x.dtype)
        report.record(name, [(arguments["x"], want_x, tol), (arguments["residual"], want_r, tol)])
        return result
    copies = {k: _clone(v) for k, v in arguments.items() if k != "out"}
    result = fn(*args, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    if name == "quant_linear":
        from ..reference.quant_gemm import quant_linear as ref_fn
    else:
        ref_fn = getattr(reference, name)
    want = ref_fn(**_reference_kwargs(ref_fn, copies))
    want = want[0] if isinstance(want, tuple) else want
    fp8 = name in ("paged_attention", "flash_prefill") and _is_fp8(arguments["k_cache"])
    tolerance = _tolerance(out.dtype, fp8)
    if name == "quant_linear":  # the kernels multiply bf16 activations (and scales)
        tolerance = max(tolerance, TOLERANCE[torch.bfloat16])
    report.record(name, [(out, want, tolerance)])
    return result


def _shadow_rope(fn: Callable, args, kwargs, arguments: dict, report: ShadowReport):
    """rope_and_cache: the reference rotates copies of q and k and writes the new K/V rows into
    a cache of its own with one slot per token (the real cache is never copied)."""
    from .. import reference

    q0, k0 = arguments["q"].clone(), arguments["k"].clone()
    q_norm, k_norm = arguments.get("q_norm"), arguments.get("k_norm")
    if q_norm is not None:  # QK-norm first, as the op's reference path does
        eps = arguments.get("norm_eps", 1e-6)
        q0.copy_(reference.rms_norm(q0, q_norm, eps))
        k0.copy_(reference.rms_norm(k0, k_norm, eps))
    slots = arguments["slot_mapping"]
    k_cache, v_cache = arguments["k_cache"], arguments["v_cache"]
    result = fn(*args, **kwargs)
    tokens = q0.shape[0]
    written = slots >= 0
    own = torch.where(written, torch.arange(tokens, device=slots.device, dtype=slots.dtype), -1)
    shape = (tokens, k_cache.shape[1], 1, k_cache.shape[3])
    k_own = torch.zeros(shape, dtype=k_cache.dtype, device=k_cache.device)
    v_own = torch.zeros(shape, dtype=v_cache.dtype, device=v_cache.device)
    reference.rope_and_cache(
        q0, k0, arguments["v"], arguments["positions"], arguments["cos_sin"], k_own, v_own, own,
        k_scale=arguments.get("k_scale"), v_scale=arguments.get("v_scale"),
    )  # fmt: skip
    rows = torch.nonzero(written).flatten()
    bs = k_cache.shape[2]
    at = slots[rows].long()

    def stored(cache):  # [rows, Hkv, D] as the kernel stored them, in float32
        return cache[at // bs, :, at % bs].float()

    tol = _tolerance(q0.dtype)
    cache_tol = _tolerance(k_cache.dtype, _is_fp8(k_cache))
    report.record(
        "rope_and_cache",
        [
            (arguments["q"], q0, tol),
            (arguments["k"], k0, tol),
            (stored(k_cache), k_own[rows, :, 0].float(), cache_tol),
            (stored(v_cache), v_own[rows, :, 0].float(), cache_tol),
        ],
    )
    return result


def _shadow_moe(fn: Callable, args, kwargs, arguments: dict, report: ShadowReport):
    """fused_moe: its output against the reference's (quantized experts: the float MLP over the
    dequantized experts, within QUANTIZED_MOE_TOLERANCE: the CPU int kernels multiply bf16
    activations), and the routing on its own as "moe_route": ops.moe.moe_route (the router
    kernel on a GPU) on a copy of the logits, its ids exactly, its weights in fp32."""
    from .. import reference
    from ..reference.moe_quantized import fused_moe_quantized
    from .moe import _quantized, moe_route

    copies = {k: _clone(v) for k, v in arguments.items()}
    result = fn(*args, **kwargs)
    options = _reference_kwargs(reference.fused_moe, copies)
    quantized = _quantized(arguments["w_gate_up"])
    want = (fused_moe_quantized if quantized else reference.fused_moe)(**options)
    tolerance = _tolerance(result.dtype)
    if quantized:
        tolerance = max(tolerance, QUANTIZED_MOE_TOLERANCE)
    report.record("fused_moe", [(result, want, tolerance)])
    route = {k: options[k] for k in ("top_k", "renormalize", "scoring")}
    weights, ids = moe_route(copies["router_logits"], **route)
    want_w, want_ids = reference.moe_route(copies["router_logits"], *route.values())
    ids_exact = 0.0
    report.record(
        "moe_route",
        [(weights, want_w, TOLERANCE[torch.float32]), (ids.float(), want_ids.float(), ids_exact)],
    )
    return result


def _wrapper(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        report = _report.get()
        if report is None:
            return fn(*args, **kwargs)
        _report.set(None)  # the op's own reference fallback is not shadowed again
        try:
            return _shadow_call(name, fn, args, kwargs, report)
        finally:
            _report.set(report)

    call.__wrapped_op__ = fn
    return call


def _install() -> None:
    from .. import ops

    for name in COMPARED:
        fn = getattr(ops, name)
        _plain[name] = fn
        setattr(ops, name, _wrapper(name, fn))


def _uninstall() -> None:
    from .. import ops

    for name, fn in _plain.items():
        setattr(ops, name, fn)
    _plain.clear()
