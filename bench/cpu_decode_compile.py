"""torch.compile of the CPU backend's decode step, measured against the eager step: start-up
(compile) time, recompiles, correctness and ms per decode step, on the default GGUF (or --model).

Not a test and not part of the model: the compiled paths live in this script only, swapped onto
one LlamaModel instance (its `layer_tail` / `hidden_states` attributes) while the engine's code
is untouched. pagedkern._cpu.gemv takes raw data pointers, which dynamo cannot trace, so it is
wrapped here in a torch custom op (pkbench::quant_gemv, with a fake for tracing) that names the
weight by its packed tiles and makes the eager step's call (ops/cpu/quant_gemv.quant_gemv).

Variants (--variants, comma-separated):
  eager            the model's ops one by one (variant cpu_layer_tail:ops): the per-op Python
                   glue that compile would replace; every ratio and delta is against it.
  fused            the engine's default: the layer tail in one C++ call (cpu_layer_tail:fused,
                   ops/cpu/layer_tail.py), the other way of removing the tail's dispatch.
  tail             torch.compile of the layer tail (O GEMV, add+RMSNorm, gate/up GEMV, SiLU x
                   mul, down GEMV, add+RMSNorm), a pure function, one graph for all 30 layers.
  loop             torch.compile of the whole per-layer loop: QKV GEMV, attention as an opaque
                   custom op (pkbench::layer_attention: the model's own _attention, RoPE + cache
                   write + the CPU decode plan, through the step's StepAttention), the tail.
  Suffixes: -max (mode="max-autotune-no-cudagraphs"), -cpp (inductor cpp_wrapper=True),
  -uncompiled (the same function run eagerly: what the custom ops and the out-of-place
  rewrite cost alone); e.g. tail,tail-max,tail-cpp,loop,loop-cpp. All dynamic=False. Prefill
  stays eager.

Per variant it reports the first call's compile time and the inductor FX-graph / AOT cache
hits (run twice with the same TORCHINDUCTOR_CACHE_DIR for cold then warm), the graphs compiled
over batch 1 from 9 to 9 + steps context tokens (context length should not recompile) and at
batch --batch (a new batch size does), the greedy tokens of a --steps decode against eager's
(identical or not, max |delta| of the logits); then (with --rounds) the us per call of one
layer's tail on fixed inputs at 1 and --batch rows, and ms per decode step, variants
interleaved round by round in this process, wall and process (CPU) time, ratios to eager.

Run (the host is shared: report ratios):
  TORCHINDUCTOR_CACHE_DIR=/tmp/pk-inductor python bench/cpu_decode_compile.py \
      --threads 1 --variants eager,tail,loop --batch 1 --steps 64 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkern.model.attention_metadata import SequenceChunk, build_batch
from pagedkern.model.llama import LlamaModel
from pagedkern.model.loading import load_model
from pagedkern.model.step_attention import StepAttention
from pagedkern.ops import cpu as cpu_ops
from pagedkern.ops import launch, variants
from pagedkern.ops.cpu import quant_gemv

BLOCK = 16


# --- the C++ GEMV as a custom op ---------------------------------------------------------------
# QuantizedWeight by the address of its packed tiles: the op's tensor argument names the weight
_WEIGHTS: dict[int, object] = {}


@torch.library.custom_op("pkbench::quant_gemv", mutates_args=())
def gemv_op(x: Tensor, tiles: Tensor, n: int) -> Tensor:
    """x [M, K] fp32 @ the weight [n, K]^T whose packed tiles are `tiles` -> [M, n] fp32: the
    call the eager step makes (ops/cpu/quant_linear.py for_step: 16-bit activations)."""
    weight = _WEIGHTS[tiles.data_ptr()]
    return quant_gemv.quant_gemv(x, weight, path=quant_gemv.best_path(), activation_bits=16)


@gemv_op.register_fake
def _(x, tiles, n):
    return x.new_empty((x.shape[0], n))


def weight_args(weight) -> tuple:
    """(tiles, n) of a QuantizedWeight for gemv_op."""
    tiles = quant_gemv.packed(weight)
    _WEIGHTS[tiles.data_ptr()] = weight
    return tiles, weight.shape[0]


def gemv(x: Tensor, w: tuple) -> Tensor:
    return gemv_op(x, *w)


# --- the layer's pieces as pure functions ------------------------------------------------------
def layer_tail(attn, residual, o, post_norm, gate_up, down, next_norm, eps: float):
    """LlamaModel.layer_tail's function for a Llama layer (no biases, SiLU), out of place."""
    h = gemv(attn.reshape(attn.shape[0], -1), o)
    residual = residual + h
    h = torch.rms_norm(residual, (residual.shape[-1],), post_norm, eps)
    gu = gemv(h, gate_up)
    d = gu.shape[-1] // 2
    h = gemv(F.silu(gu[:, :d]) * gu[:, d:], down)
    residual = residual + h
    return torch.rms_norm(residual, (residual.shape[-1],), next_norm, eps), residual


class Step:
    """What the attention op of the current step reads (set by hidden_states each step)."""

    model: LlamaModel
    meta = None
    kv_cache = None
    attention: StepAttention | None = None


@torch.library.custom_op("pkbench::layer_attention", mutates_args=("qkv",))
def attention_op(qkv: Tensor, layer: int) -> Tensor:
    """The model's _attention of layer `layer` in the current Step: RoPE (q, k rotated in qkv),
    the cache write, attention -> [T, Hq, D]. The KV cache is written as a side effect: no op
    of the graph reads it."""
    m, cfg = Step.model, Step.model.local
    out = torch.empty(qkv.shape[0], cfg.num_heads, cfg.head_dim)
    k_cache, v_cache = Step.kv_cache.layers[layer]
    m._attention(
        qkv, m.weights.layers[layer], Step.meta, k_cache, v_cache, out, None, layer,
        Step.attention,
    )  # fmt: skip
    return out


@attention_op.register_fake
def _(qkv, layer):
    cfg = Step.model.local
    return qkv.new_empty((qkv.shape[0], cfg.num_heads, cfg.head_dim))


# --- swapping the compiled pieces onto one model ----------------------------------------------
class Swap:
    """A model's layers' weights as gemv_op arguments, and the compiled paths put on it."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        w = model.weights
        self.layers = [
            (weight_args(lw.qkv), weight_args(lw.o), lw.post_norm, weight_args(lw.gate_up),
             weight_args(lw.down), model.next_norm(i))
            for i, lw in enumerate(w.layers)
        ]  # fmt: skip
        self.index = {id(lw): i for i, lw in enumerate(w.layers)}
        self.eps = model.local.rms_norm_eps
        self.decoding = False  # prefill runs the eager tail (another T: another graph)
        self.tail_rows = 1  # tail_calls' batch
        Step.model = model

    def reset(self) -> None:
        for name in ("layer_tail", "hidden_states"):
            self.model.__dict__.pop(name, None)

    def use_tail(self, compiled: Callable) -> None:
        self.reset()
        eager = LlamaModel.layer_tail.__get__(self.model)

        def tail(attn, residual, layer, next_norm):
            if not self.decoding:
                return eager(attn, residual, layer, next_norm)
            _, o, post, gate_up, down, nxt = self.layers[self.index[id(layer)]]
            return compiled(attn, residual, o, post, gate_up, down, nxt, self.eps)

        self.model.layer_tail = tail

    def use_loop(self, compiled: Callable) -> None:
        self.reset()
        model, eager = self.model, LlamaModel.hidden_states.__get__(self.model)
        layers, eps = self.layers, self.eps

        def hidden_states(input_ids, meta, kv_cache, attention=None):
            if not self.decoding:
                return eager(input_ids, meta, kv_cache, attention)
            model._ops = model._step_ops(meta, kv_cache)
            Step.meta, Step.kv_cache = meta, kv_cache
            Step.attention = attention or StepAttention(meta, model._cpu.decode_copies)
            h, residual = model.embed_and_norm(input_ids, model.weights.layers[0].input_norm)
            return compiled(h, residual, layers, eps)

        model.hidden_states = hidden_states


def layer_loop(h, residual, layers, eps: float):
    """Every layer of a decode step: QKV GEMV, attention (custom op), the tail."""
    for i, (qkv_w, o, post, gate_up, down, nxt) in enumerate(layers):
        attn = attention_op(gemv(h, qkv_w), i)
        h, residual = layer_tail(attn, residual, o, post, gate_up, down, nxt, eps)
    return h


def compiled_fn(variant: str) -> Callable:
    """torch.compile of the tail or the loop as the variant's suffixes say (mode and options
    exclude each other: with cpp_wrapper the mode goes in as max_autotune)."""
    base, *flags = variant.split("-")
    fn = layer_tail if base == "tail" else layer_loop
    if "uncompiled" in flags:
        return fn
    if "cpp" in flags:
        return torch.compile(
            fn, dynamic=False, options={"cpp_wrapper": True, "max_autotune": "max" in flags}
        )
    mode = "max-autotune-no-cudagraphs" if "max" in flags else "default"
    return torch.compile(fn, mode=mode, dynamic=False)


# --- decoding ---------------------------------------------------------------------------------
class Decoder:
    """Greedy decode of `batch` sequences from fixed prompts over the model's paged cache."""

    def __init__(self, model: LlamaModel, swap: Swap, batch: int, steps: int, prompt: int = 8):
        self.model, self.swap, self.batch, self.steps = model, swap, batch, steps
        per_seq = -(-(prompt + steps + 1) // BLOCK)
        self.kv = model.allocate_kv_cache(batch * per_seq + 1, BLOCK)
        self.tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
        self.prompts = [[(37 * b + 11 * j + 5) % 40000 + 100 for j in range(prompt)]
                        for b in range(batch)]  # fmt: skip

    def run(self, timed: bool = False):
        """(tokens [steps, batch], logits [steps, batch, V] or None, wall s, CPU s) of the
        decode steps (the prefill before them is untimed and eager)."""
        m, swap = self.model, self.swap
        m._cpu.decode_copies.clear()
        swap.decoding = False
        chunks = [SequenceChunk(p, 0, t) for p, t in zip(self.prompts, self.tables, strict=True)]
        ids, meta = build_batch(chunks, BLOCK)
        next_ids = m.forward(ids, meta, self.kv).argmax(-1)
        pos = [len(p) for p in self.prompts]
        swap.decoding = True
        tokens, logits = [], []
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(self.steps):
            toks = next_ids.tolist()
            chunks = [SequenceChunk([t], n, tb) for t, n, tb in zip(toks, pos, self.tables)]
            ids, meta = build_batch(chunks, BLOCK)
            out = m.forward(ids, meta, self.kv)
            next_ids = out.argmax(-1)
            tokens.append(toks)
            if not timed:
                logits.append(out)
            pos = [n + 1 for n in pos]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        swap.decoding = False
        return torch.tensor(tokens), (torch.stack(logits) if logits else None), wall, cpu


def kernels(variant: str):
    """The kernel variants a variant runs under: only `fused` takes the C++ layer tail."""
    return variants.use_kernels(cpu_layer_tail="fused" if variant == "fused" else "ops")


def select(swap: Swap, fns: dict, variant: str) -> None:
    """Put the variant's compiled function on the model (the eager ones: none)."""
    if variant in ("eager", "fused"):
        swap.reset()
    elif variant.startswith("tail"):
        swap.use_tail(fns[variant])
    else:
        swap.use_loop(fns[variant])


def tail_calls(model: LlamaModel, swap: Swap, fns: dict, names: list[str], rounds: int):
    """{variant: [(wall us, CPU us) per call, a round]} of one layer's tail on fixed inputs
    [batch, ...] (layer 3), 200 calls a round, the variants interleaved: eager = the model's
    layer_tail on the ops, fused = the same method taking the C++ tail, tail* = the function."""
    from pagedkern.ops import cpu as ops

    layer, i = model.weights.layers[3], 3
    _, o, post, gate_up, down, nxt = swap.layers[i]
    cfg = model.local
    attn = torch.randn(swap.tail_rows, cfg.num_heads, cfg.head_dim)
    residual = torch.randn(swap.tail_rows, cfg.hidden_size)
    calls: dict[str, Callable] = {}
    for v in names:
        if v in ("eager", "fused"):

            def call(v=v):
                with kernels(v):
                    model._ops = ops.step_implementations()
                    tail = model._cpu.tail
                    tail = None if tail is None else tail.for_step()

                def run():
                    model._tail = tail  # (each variant its own: the attribute is shared)
                    return model.layer_tail(attn, residual.clone(), layer, nxt)

                return run

            calls[v] = call()
        elif v.startswith("tail"):
            fn = fns[v]
            calls[v] = lambda fn=fn: fn(attn, residual.clone(), o, post, gate_up, down, nxt,
                                        swap.eps)  # fmt: skip
    out: dict[str, list[tuple[float, float]]] = {v: [] for v in calls}
    with torch.inference_mode():
        for f in calls.values():
            f()
        for _ in range(rounds):
            for v, f in calls.items():
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(200):
                    f()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                out[v].append((wall / 200 * 1e6, cpu / 200 * 1e6))
    model._tail = None
    return out


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF path (default: SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default="eager,tail,loop")
    parser.add_argument("--batch", type=int, default=1, help="timed batch (recompile check too)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    launch.set_backend("cpu")
    assert cpu_ops.quant_gemv.available(), cpu_ops.quant_gemv.unavailable_reason()
    model, _ = load_model(args.model, "cpu")
    swap = Swap(model)
    variants_run = args.variants.split(",")
    one = Decoder(model, swap, 1, args.steps)
    timed = Decoder(model, swap, args.batch, args.steps) if args.batch != 1 else one
    counters = torch._dynamo.utils.counters

    swap.reset()
    with kernels("eager"):
        ref_tokens, ref_logits, _, _ = one.run()
        ref_timed = timed.run()[0] if timed is not one else ref_tokens
    fns: dict[str, Callable] = {}
    print(f"torch {torch.__version__}, threads {args.threads}, batch {args.batch}")
    print("variant | compile s (first call) | fxgraph hit/miss | aot hit | graphs b1 | "
          f"+b{args.batch} | tokens same | max |dlogit|")  # fmt: skip
    for v in variants_run:
        if v == "eager":
            continue
        counters.clear()
        if v != "fused":
            fns[v] = compiled_fn(v)
        select(swap, fns, v)
        with kernels(v):
            one.steps, saved = 1, one.steps
            t = time.perf_counter()
            one.run()  # the first decode step compiles
            start = time.perf_counter() - t
            one.steps = saved
            hits = counters["inductor"]
            tokens, logits, _, _ = one.run()  # context 9 .. 9 + steps: recompiles counted
            g1 = graphs()
            tb = timed.run()[0] if timed is not one else tokens
        same = bool(torch.equal(tokens, ref_tokens)) and bool(torch.equal(tb, ref_timed))
        delta = (logits - ref_logits).abs().max().item()
        print(f"{v} | {start:.1f} | {hits['fxgraph_cache_hit']}/{hits['fxgraph_cache_miss']} | "
              f"{counters['aot_autograd']['autograd_cache_hit']} | {g1} | {graphs() - g1} | "
              f"{same} | {delta:.2e}")  # fmt: skip

    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants_run}
    for _ in range(args.rounds):
        for v in variants_run:
            select(swap, fns, v)
            with kernels(v):
                _, _, wall, cpu = timed.run(timed=True)
            times[v].append((wall / args.steps * 1e3, cpu / args.steps * 1e3))
    swap.reset()
    if not args.rounds:
        return
    for rows in sorted({1, args.batch}):
        swap.tail_rows = rows
        micro = tail_calls(model, swap, fns, variants_run, args.rounds)
        print(f"\none layer's tail, {rows} row(s): us per call, median of {args.rounds} rounds")
        print("variant | wall us | CPU us | CPU / eager")
        ref = statistics.median(c for _, c in micro["eager"]) if "eager" in micro else None
        for v, ts in micro.items():
            w, c = statistics.median(x for x, _ in ts), statistics.median(y for _, y in ts)
            print(f"{v} | {w:.1f} | {c:.1f} | {f'{c / ref:.3f}' if ref else '-'}")
    base = statistics.median(w for w, _ in times["eager"]) if "eager" in times else None
    base_cpu = statistics.median(c for _, c in times["eager"]) if "eager" in times else None
    print(f"\nms per decode step (batch {args.batch}), median of {args.rounds} interleaved rounds")
    print("variant | wall ms | CPU ms | wall / eager | CPU / eager | rounds (wall)")
    for v, ts in times.items():
        w = statistics.median(x for x, _ in ts)
        c = statistics.median(y for _, y in ts)
        rw = f"{w / base:.3f}" if base else "-"
        rc = f"{c / base_cpu:.3f}" if base_cpu else "-"
        each = " ".join(f"{x:.1f}" for x, _ in ts)
        print(f"{v} | {w:.2f} | {c:.2f} | {rw} | {rc} | {each}")


if __name__ == "__main__":
    main()
