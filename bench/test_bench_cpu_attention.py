"""CPU attention, side by side and interleaved (other work on the machine shifts absolute times;
ratios measured in one run hold): the reference (the whole score matrix), the CPU backend's
C++ kernel (csrc/cpu/attention.cpp, the default; on an AVX-512 CPU its AVX2 path too) and its
BLAS tiles (cpu_attention:tiles, ops/cpu/attention.py), and torch's fused CPU
scaled_dot_product_attention over the gathered pages (a candidate, but its tiling follows the
query count, so a row's bits depend on its chunk: not batch invariant).

SmolLM2-135M's heads (9 query heads, 3 KV heads, head dim 64) and Qwen3-0.6B's (16, 8, 128;
full sizes only), blocks of 16, one whole prompt of 512 / 2048 / 4000 tokens, and decode rows
(batch 1 and 16) over 64 .. 4000 keys; GFLOP/s against one large fp32 GEMM's (torch.mm: the
host's measured ceiling). Full sizes with PAGEDKERN_BENCH_SMOKE=0 (or PAGEDKERN_BENCH_CPU=1);
smoke mode runs 64 tokens once."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from measure import smoke_mode

from pagedkern import reference
from pagedkern.ops.cpu import attention, attention_kernel
from pagedkern.ops.variants import use_kernels

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
LENGTHS = (512, 2048, 4000) if FULL else (64,)
ROUNDS = 3 if FULL else 1
BS = 16
# (query heads, KV heads, head dim)
SHAPES = {"smollm2": (9, 3, 64), "qwen3-0.6b": (16, 8, 128)}
SHAPE_IDS = list(SHAPES) if FULL else ["smollm2"]


def _inputs(n: int, shape: str = "smollm2"):
    hq, hkv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(n)
    blocks = -(-n // BS)
    k = torch.randn(blocks + 1, hkv, BS, d, generator=g)
    v = torch.randn(blocks + 1, hkv, BS, d, generator=g)
    q = torch.randn(n, hq, d, generator=g)
    table = (torch.randperm(blocks, generator=g) + 1).int()[None]
    return q, k, v, torch.tensor([0, n], dtype=torch.int32), table, torch.tensor([n]).int()


def _sdpa(q, k, v, cu, table, lens):
    n, hkv, d = q.shape[0], k.shape[1], k.shape[3]
    keys = k[table[0].long()].transpose(0, 1).reshape(hkv, -1, d)[:, :n]
    values = v[table[0].long()].transpose(0, 1).reshape(hkv, -1, d)[:, :n]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], is_causal=True, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _variant(name: str, op):
    """op under cpu_attention:`name`."""

    def run(*args):
        with use_kernels(cpu_attention=name):
            return op(*args)

    return run


def _kernel_path(path: str, decode: bool = False):
    """The kernel on one of its ISA paths (the op runs the best this CPU has)."""

    def run(q, k, v, *rest):
        if decode:  # (q, k, v, tables, seq_lens): one row a sequence, at its last position
            tables, lens = rest
            cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        else:
            cu, tables, lens = rest
        out = torch.empty(q.shape)
        rows = attention_kernel.chunk_rows(cu, lens, q.shape[0])
        scale = q.shape[2] ** -0.5
        return attention_kernel.attend(q, k, v, tables, *rows, out, scale=scale, path=path)

    return run


# the kernel's other paths this CPU runs, beside its default (the best)
_AVX512 = attention_kernel.path_supported("avx512")
OTHER_PATHS = [p for p in ("avx2",) if _AVX512 and attention_kernel.path_supported(p)]
CANDIDATES = {
    "reference": reference.flash_prefill,
    "cpu backend (kernel)": _variant("kernel", attention.flash_prefill),
    **{f"kernel, {p} path": _kernel_path(p) for p in OTHER_PATHS},
    "cpu backend (tiles)": _variant("tiles", attention.flash_prefill),
    "torch sdpa (gathered)": _sdpa,
}
DECODE_CANDIDATES = {
    "reference": reference.paged_attention,
    "cpu backend (kernel)": _variant("kernel", attention.paged_attention),
    **{f"kernel, {p} path": _kernel_path(p, decode=True) for p in OTHER_PATHS},
    "cpu backend (tiles)": _variant("tiles", attention.paged_attention),
}


def _gemm_gflops() -> float:
    """One large fp32 GEMM's rate on this host (best of 3): the ceiling the GFLOP/s compare to."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 1024**3 / best / 1e9


def _best_times(candidates: dict, args: tuple, want: torch.Tensor, rounds: int) -> dict:
    """Each candidate's best time over `rounds` interleaved rounds (each round times every
    candidate once), its output checked against `want`."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            got = fn(*args)
            times[name].append(time.perf_counter() - start)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    return {name: min(t) for name, t in times.items()}


@pytest.mark.parametrize("shape", SHAPE_IDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_cpu_prefill_attention(n, shape, capsys):
    args = _inputs(n, shape)
    best = _best_times(CANDIDATES, args, reference.flash_prefill(*args), ROUNDS)
    hq, _, d = SHAPES[shape]
    flops = 4 * hq * d * n * (n + 1) / 2  # causal: q.k and p.v over the visible keys
    ceiling = _gemm_gflops()
    with capsys.disabled():
        print(
            f"\nprefill attention, {shape} heads {SHAPES[shape]}, {n} tokens, "
            f"{torch.get_num_threads()} threads (best of "
            f"{ROUNDS}); fp32 GEMM ceiling {ceiling:.0f} GFLOP/s"
        )
        for name, t in best.items():
            ratio = best["reference"] / t
            rate = flops / t / 1e9
            print(
                f"  {name:24s} {t * 1e3:9.1f} ms  {ratio:5.2f}x the reference  "
                f"{rate:6.1f} GFLOP/s ({rate / ceiling:4.0%} of the GEMM)"
            )


DECODE_LENGTHS = (64, 600, 2000, 4000) if FULL else (64,)


@pytest.mark.parametrize("shape", SHAPE_IDS)
@pytest.mark.parametrize("batch", [1, 16])
def test_cpu_decode_attention(batch, shape, capsys):
    """One decode row per sequence, every sequence `length` keys (the one-shot ops: the tiles'
    planned decode step, which keeps a copy between steps, is measured in the engine)."""
    lines = []
    for length in DECODE_LENGTHS:
        q, k, v, _, table, lens = _inputs(length, shape)
        q = q[:batch] if batch <= length else q[:1].repeat(batch, 1, 1)
        tables, seq_lens = table.repeat(batch, 1), lens.repeat(batch)
        args = (q, k, v, tables, seq_lens)
        want = reference.paged_attention(*args)
        best = _best_times(DECODE_CANDIDATES, args, want, ROUNDS * 3)
        hq, _, d = SHAPES[shape]
        flops = 4 * hq * d * length * batch
        cells = "  ".join(
            f"{name} {t * 1e6:8.0f} us ({flops / t / 1e9:5.1f} GFLOP/s)" for name, t in best.items()
        )
        lines.append(f"  {length:5d} keys: {cells}")
    with capsys.disabled():
        threads = torch.get_num_threads()
        print(
            f"\ndecode attention, {shape} heads {SHAPES[shape]}, batch {batch}, {threads} threads"
        )
        print("\n".join(lines))
