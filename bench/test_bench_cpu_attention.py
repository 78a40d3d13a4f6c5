"""CPU prefill attention, side by side and interleaved (other work on the machine shifts
absolute times; ratios measured in one run hold): the reference (the whole score matrix), the
CPU backend's flash-style tiles (ops/cpu/attention.py), and torch's fused CPU
scaled_dot_product_attention over the gathered pages (a candidate: fastest, but its tiling
follows the query count, so a row's bits depend on its chunk: not batch invariant).

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, blocks of 16), one whole prompt
of 512 / 2048 / 4000 tokens. Full sizes with PAGEDKERN_BENCH_SMOKE=0 (or PAGEDKERN_BENCH_CPU=1);
smoke mode runs 64 tokens once."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from measure import smoke_mode

from pagedkern import reference
from pagedkern.ops.cpu import attention

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
LENGTHS = (512, 2048, 4000) if FULL else (64,)
ROUNDS = 3 if FULL else 1
HQ, HKV, D, BS = 9, 3, 64, 16


def _inputs(n: int):
    g = torch.Generator().manual_seed(n)
    blocks = -(-n // BS)
    k = torch.randn(blocks + 1, HKV, BS, D, generator=g)
    v = torch.randn(blocks + 1, HKV, BS, D, generator=g)
    q = torch.randn(n, HQ, D, generator=g)
    table = (torch.randperm(blocks, generator=g) + 1).int()[None]
    return q, k, v, torch.tensor([0, n], dtype=torch.int32), table, torch.tensor([n]).int()


def _sdpa(q, k, v, cu, table, lens):
    n = q.shape[0]
    keys = k[table[0].long()].transpose(0, 1).reshape(HKV, -1, D)[:, :n]
    values = v[table[0].long()].transpose(0, 1).reshape(HKV, -1, D)[:, :n]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], is_causal=True, enable_gqa=True
    )
    return out[0].transpose(0, 1)


CANDIDATES = {
    "reference": reference.flash_prefill,
    "cpu backend (tiles)": attention.flash_prefill,
    "torch sdpa (gathered)": _sdpa,
}


@pytest.mark.parametrize("n", LENGTHS)
def test_cpu_prefill_attention(n, capsys):
    args = _inputs(n)
    want = reference.flash_prefill(*args)
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    for _ in range(ROUNDS):  # interleaved: each round times every candidate once
        for name, fn in CANDIDATES.items():
            start = time.perf_counter()
            got = fn(*args)
            times[name].append(time.perf_counter() - start)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    best = {name: min(t) for name, t in times.items()}
    with capsys.disabled():
        print(
            f"\nprefill attention, {n} tokens, {torch.get_num_threads()} threads (best of {ROUNDS})"
        )
        for name, t in best.items():
            ratio = best["reference"] / t
            print(f"  {name:24s} {t * 1e3:9.1f} ms  {ratio:5.2f}x the reference")
