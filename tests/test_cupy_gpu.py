"""The "CuPy users need no torch" claim, on a device: a few kernels driven by CuPy arrays alone in
a subprocess where torch cannot be imported (tools/rehearsal/sitecustomize.py blocks it), each
checked against float64 CuPy math on fresh random inputs, outputs poisoned with NaN first.
The CPU test checks the harness itself: in that subprocess pagedkern imports, torch does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK_ENV = "PAGEDKERN_BLOCK_IMPORTS"  # read by tools/rehearsal/sitecustomize.py

KERNELS_ON_CUPY = r"""
import sys

import cupy as cp

import pagedkern

rng = cp.random.RandomState(20261201)  # legacy API: has permutation() in CuPy too
TOL = {"float16": 2e-3, "float32": 1e-5}


def rel_err(out, ref):
    assert not cp.isnan(out).any(), "NaN in the output (poison survived or kernel produced it)"
    diff = cp.linalg.norm(out.astype(cp.float64) - ref)
    return float(diff / max(float(cp.linalg.norm(ref)), 1e-30))


def check(name, out, ref, dtype):
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{name} {dtype}: relative error {err:.3g} > {TOL[dtype]}"
    print(f"{name} {dtype} {tuple(out.shape)}: relative error {err:.2e}")


def rms64(x, w, eps=1e-6):
    x = x.astype(cp.float64)
    return x / cp.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(cp.float64)


for dtype, (rows, hidden) in (("float16", (33, 4096)), ("float32", (7, 111))):
    x = (rng.standard_normal((rows, hidden)) * 3).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(hidden)).astype(dtype)
    out = cp.full((rows, hidden), cp.nan, dtype=dtype)
    assert pagedkern.rms_norm(x, w, 1e-6, out=out) is out
    check("rms_norm", out, rms64(x, w), dtype)

x = rng.standard_normal((19, 2048)).astype("float16")
res = rng.standard_normal((19, 2048)).astype("float16")
w = (1 + 0.5 * rng.standard_normal(2048)).astype("float16")
expected_res = (x.astype(cp.float32) + res.astype(cp.float32)).astype("float16")
pagedkern.fused_add_rms_norm(x, res, w, 1e-6)
assert cp.array_equal(res, expected_res), "fused_add_rms_norm: residual is not x + residual"
check("fused_add_rms_norm", x, rms64(res, w), "float16")

x = (rng.standard_normal((17, 2 * 1536)) * 4).astype("float16")
out = cp.full((17, 1536), cp.nan, dtype="float16")
pagedkern.silu_and_mul(x, out=out)
x64 = x.astype(cp.float64)
check("silu_and_mul", out, x64[:, :1536] / (1 + cp.exp(-x64[:, :1536])) * x64[:, 1536:], "float16")

logits = (rng.standard_normal((6, 32000)) * 4).astype("float32")
seeds = cp.arange(6, dtype=cp.int64) * 7919
greedy = pagedkern.sample(logits, 0.0, 1.0, 0, seeds)
top1 = pagedkern.sample(logits, 0.8, 0.9, 1, seeds)  # top-k 1 keeps only the argmax
assert isinstance(greedy, cp.ndarray) and greedy.dtype == cp.int32
argmax = logits.argmax(-1).astype(cp.int32)
assert cp.array_equal(greedy, argmax) and cp.array_equal(top1, argmax), (greedy, top1, argmax)
print("sample: greedy and top-k 1 equal the argmax")

hq, hkv, d, bs, lens = 8, 2, 128, 16, [1, 37, 300]
pages = [-(-n // bs) for n in lens]
order = rng.permutation(sum(pages)).astype(cp.int32)
tables = cp.zeros((len(lens), max(pages)), dtype=cp.int32)
start = 0
for b, n in enumerate(pages):
    tables[b, :n] = order[start : start + n]
    start += n
k_cache = rng.standard_normal((sum(pages), hkv, bs, d)).astype("float16")
v_cache = rng.standard_normal((sum(pages), hkv, bs, d)).astype("float16")
q = rng.standard_normal((len(lens), hq, d)).astype("float16")
out = cp.full(q.shape, cp.nan, dtype="float16")
pagedkern.paged_attention(q, k_cache, v_cache, tables, cp.asarray(lens, dtype=cp.int32), out=out)
ref = cp.zeros(q.shape, dtype=cp.float64)
for b, n in enumerate(lens):
    t = cp.arange(n)
    page = tables[b, t // bs]
    keys = k_cache[page, :, t % bs].astype(cp.float64)  # [n, hkv, d]
    values = v_cache[page, :, t % bs].astype(cp.float64)
    for h in range(hq):
        scores = keys[:, h // (hq // hkv)] @ q[b, h].astype(cp.float64) / d**0.5
        p = cp.exp(scores - scores.max())
        ref[b, h] = (p / p.sum()) @ values[:, h // (hq // hkv)]
check("paged_attention", out, ref, "float16")

assert "torch" not in sys.modules, "torch was imported"
print("all ops ran on CuPy arrays without torch")
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    path = [str(ROOT / "tools" / "rehearsal"), str(ROOT / "python")]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), BLOCK_ENV: "torch"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_subprocess_imports_pagedkern_but_not_torch():
    proc = run_without_torch(
        "import sys, pagedkern\n"
        "print('cuda_available', pagedkern.cuda_available())\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
    )
    assert "cuda_available" in proc.stdout, proc.stderr
    assert proc.returncode != 0
    assert "No module named 'torch' (blocked)" in proc.stderr


@pytest.mark.gpu
def test_kernels_on_cupy_arrays_without_torch():
    pytest.importorskip("cupy")
    proc = run_without_torch(KERNELS_ON_CUPY)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all ops ran on CuPy arrays without torch" in proc.stdout
