"""The CPU backend's fixed-order fp32 GEMM (csrc/cpu/dense_gemm.cpp, `cpu_linear:fixed_order`)
against torch's F.linear (oneDNN / MKL, `cpu_linear:blas`), interleaved (each case times both
before the next), at SmolLM2-135M's shapes (QKV, gate/up, down, a slice of its LM head) and a
~1B model's (2048 hidden, 8192 intermediate), M = 1 .. 512. Prints microseconds, GFLOP/s and
blas / fixed (above 1: the fixed order is faster). test_cpu_dense_gemv_from_dram times one row
as a decode runs it, over copies of the weight that pass the last-level cache, beside the copy
bandwidth of as many bytes (the ceiling a GEMV approaches). Threads: PAGEDKERN_BENCH_THREADS
(default 1). Full sizes with PAGEDKERN_BENCH_CPU=1 (or PAGEDKERN_BENCH_SMOKE=0) on a machine
without a GPU; smoke mode runs tiny shapes once."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from measure import best_host_us, host_copy_bandwidth, smoke_mode

from pagedkern.ops.cpu import dense_linear, quant_gemv

FULL = not smoke_mode() or os.environ.get("PAGEDKERN_BENCH_CPU") == "1"
if FULL and torch.cuda.is_available():
    pytest.skip("a CPU benchmark; this machine has a GPU", allow_module_level=True)
THREADS = int(os.environ.get("PAGEDKERN_BENCH_THREADS", 1))
SHAPES = (
    [("135m qkv", 960, 576), ("135m gate_up", 3072, 576), ("135m down", 576, 1536),
     ("135m lm_head/8", 6144, 576), ("1b gate_up", 16384, 2048), ("1b down", 2048, 8192)]
    if FULL else [("tiny", 64, 96)]
)  # fmt: skip
MS = (1, 4, 16, 64, 256, 512) if FULL else (1, 5)
pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu not built")


def _best_us(fn, reps: int) -> float:
    return best_host_us(fn, reps, 3 if FULL else 1)


def test_cpu_dense_gemm(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k)
        for m in MS:
            x = torch.randn(m, k)
            reps = max(2, int(2e8 / (n * k * m))) if FULL else 1
            ours = _best_us(lambda: dense_linear.dense_gemm(x, w), reps)  # noqa: B023
            theirs = _best_us(lambda: F.linear(x, w), reps)  # noqa: B023
            flops = 2 * m * n * k / 1e3
            lines.append(
                f"  {name:16s} M={m:<4d} {ours:10.1f} {theirs:10.1f} {flops / ours:8.1f} "
                f"{flops / theirs:8.1f} {theirs / ours:10.2f}x"
            )
    with capsys.disabled():
        print(f"\nCPU fp32 GEMM, {THREADS} thread(s); microseconds (best of 3), GFLOP/s")
        print(
            f"  {'weight':16s} {'M':6s} {'fixed':>10s} {'blas':>10s} {'GF/s':>8s} {'GF/s':>8s} "
            f"{'blas/fixed':>11s}"
        )
        print("\n".join(lines))


# one row over copies of each weight past DRAM_BYTES: read from DRAM, as a decode reads a model
DRAM_BYTES = (768 << 20) if FULL else (1 << 18)
DRAM_SHAPES = (
    [("1b gate_up", 16384, 2048), ("1b down", 2048, 8192), ("135m gate_up", 3072, 576)]
    if FULL else [("tiny", 64, 256)]
)  # fmt: skip


def _rotating(fn, x: torch.Tensor, copies: list[torch.Tensor]):
    """fn(x, the next copy) at each call: each weight read from DRAM, as a decode reads a model"""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(x, copies[state["i"]])

    return call


def test_cpu_dense_gemv_from_dram(capsys):
    torch.set_num_threads(THREADS)
    lines = []
    for name, n, k in DRAM_SHAPES:
        nbytes = n * k * 4
        copies = [torch.randn(n, k) for _ in range(max(2, DRAM_BYTES // nbytes))]
        x = torch.randn(1, k)
        reps = len(copies)
        ours = _best_us(_rotating(dense_linear.dense_gemm, x, copies), reps)
        theirs = _best_us(_rotating(F.linear, x, copies), reps)
        lines.append(
            f"  {name:16s} {ours:10.1f} {theirs:10.1f} {nbytes / ours / 1e3:8.1f} "
            f"{nbytes / theirs / 1e3:8.1f} {theirs / ours:10.2f}x"
        )
    copy = host_copy_bandwidth((256 << 20) if FULL else 1 << 16)
    with capsys.disabled():
        print(
            f"\nCPU fp32 GEMV from DRAM, {THREADS} thread(s), copy bandwidth {copy:.1f} GB/s; "
            "microseconds (best of 3), weight GB/s"
        )
        print(
            f"  {'weight':16s} {'fixed':>10s} {'blas':>10s} {'GB/s':>8s} {'GB/s':>8s} "
            f"{'blas/fixed':>11s}"
        )
        print("\n".join(lines))


def test_cpu_dense_16_bit_weights(capsys):
    """The same weights stored fp32, bf16 and fp16 (a 16-bit checkpoint's projections on the
    CPU backend): one row from DRAM, as a decode reads them, and M rows from the caches."""
    torch.set_num_threads(THREADS)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    lines = []
    for name, n, k in DRAM_SHAPES:
        fp32 = [torch.randn(n, k) for _ in range(max(2, DRAM_BYTES // (n * k * 4)))]
        for m in (1, 4, 16, 64, 256) if FULL else (1, 5):
            x = torch.randn(m, k)
            us = {}
            for dtype in dtypes:  # (from DRAM at M = 1, 4: the weights rotate through copies)
                copies = [w.to(dtype) for w in fp32] if m <= 4 else [fp32[0].to(dtype)]
                fn = _rotating(dense_linear.dense_gemm, x, copies)
                us[dtype] = _best_us(fn, len(copies) if m <= 4 else 2)
            bf16, fp16 = (
                us[torch.float32] / us[torch.bfloat16],
                us[torch.float32] / us[torch.float16],
            )
            lines.append(
                f"  {name:16s} M={m:<4d} {us[torch.float32]:10.1f} {us[torch.bfloat16]:10.1f} "
                f"{us[torch.float16]:10.1f} {bf16:8.2f}x {fp16:8.2f}x"
            )
    with capsys.disabled():
        print(f"\nCPU GEMM by weight dtype, {THREADS} thread(s); microseconds (best of 3)")
        print(
            f"  {'weight':16s} {'M':6s} {'fp32':>10s} {'bf16':>10s} {'fp16':>10s} "
            f"{'fp32/bf16':>9s} {'fp32/fp16':>9s}"
        )
        print("\n".join(lines))


# the engine on an fp32 model of SmolLM2-135M's shape: a prefill, one stream's decode, 16 streams'
ENGINE_MODEL, PREFILL, DECODE = (
    ("synthetic:smollm2-135m", 512, 64) if FULL else ("synthetic:tiny", 16, 4)
)


def _engine_rates(variant: str) -> tuple[float, float, float]:
    """(prefill tok/s, 1-stream decode tok/s, 16-stream decode tok/s) under cpu_linear:variant"""
    from pagedkern.engine import Engine, EngineConfig, SamplingParams
    from pagedkern.ops.variants import use_kernels

    with use_kernels(cpu_linear=variant):
        engine = Engine.from_config(
            EngineConfig(model=ENGINE_MODEL, backend="cpu", max_num_batched_tokens=PREFILL)
        )

        def run(prompts: list[list[int]], tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            for ids in prompts:
                engine.add_request(prompt_ids=ids, params=params)
            t0 = time.perf_counter()
            while engine.has_unfinished:
                engine.step()
            return time.perf_counter() - t0

        # (each prompt its own: a repeated one would be read from the prefix cache)
        prefill = PREFILL / min(
            run([[5 + (i * (r + 3)) % 97 for i in range(PREFILL)]], 1) for r in range(2)
        )
        one = run([[7, 8, 9]], DECODE + 1) - run([[7, 8, 9]], 1)
        many = run([[7 + s, 8, 9] for s in range(16)], DECODE + 1) - run(
            [[7 + s, 8, 9] for s in range(16)], 1
        )
    return prefill, DECODE / one, 16 * DECODE / many


def test_cpu_dense_linear_engine(capsys):
    torch.set_num_threads(THREADS)
    rates = {v: [] for v in ("fixed_order", "blas")}
    for _ in range(2 if FULL else 1):  # interleaved rounds, best of each
        for variant in rates:
            rates[variant].append(_engine_rates(variant))
    best = {v: [max(r[i] for r in runs) for i in range(3)] for v, runs in rates.items()}
    with capsys.disabled():
        print(
            f"\n{ENGINE_MODEL} fp32 on the CPU backend, {THREADS} thread(s); tokens/s (best of 2)"
        )
        print(f"  {'':14s} {'prefill ' + str(PREFILL):>12s} {'decode x1':>10s} {'decode x16':>10s}")
        for variant, (p, one, many) in best.items():
            print(f"  {variant:14s} {p:12.1f} {one:10.1f} {many:10.1f}")
        ratio = [f / b for f, b in zip(best["fixed_order"], best["blas"], strict=True)]
        print(f"  {'fixed / blas':14s} {ratio[0]:11.2f}x {ratio[1]:9.2f}x {ratio[2]:9.2f}x")


# An HF checkpoint of SmolLM2-135M's shape (random weights) saved in bf16 and as its fp32 copy
CHECKPOINT = (
    dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
         num_key_value_heads=3, vocab_size=49152)
    if FULL else
    dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=400)
)  # fmt: skip


def _checkpoint_rates(folder) -> tuple[float, float, float, list[int], float]:
    """(prefill tok/s, 1-stream decode tok/s, 16-stream decode tok/s, greedy ids, linear and
    embedding MiB) of the engine on `folder`, CPU backend."""
    from pagedkern.engine import Engine, EngineConfig, SamplingParams

    engine = Engine.from_config(
        EngineConfig(model=str(folder), backend="cpu", max_num_batched_tokens=PREFILL)
    )

    def run(prompts: list[list[int]], tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        requests = [engine.add_request(prompt_ids=ids, params=params) for ids in prompts]
        t0 = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        return time.perf_counter() - t0, list(requests[0].output_ids)

    prefill = PREFILL / run([[5 + (i * 7) % 97 for i in range(PREFILL)]], 1)[0]
    one, ids = run([[7, 8, 9]], DECODE + 1)
    one -= run([[7, 8, 9]], 1)[0]
    many = run([[7 + s, 8, 9] for s in range(16)], DECODE + 1)[0]
    many -= run([[7 + s, 8, 9] for s in range(16)], 1)[0]
    w = engine.model.weights
    tensors = [t for layer in w.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    mib = sum(t.numel() * t.element_size() for t in [*tensors, w.embed]) / 2**20
    return prefill, DECODE / one, 16 * DECODE / many, ids, mib


def _write_gguf(path, model, dtype: torch.dtype) -> None:
    """The HF model's tensors as llama.cpp's converter writes a "llama" GGUF (Q/K permuted),
    matrices in BF16 (its bits) or F32; the test tokenizer (the embedding's other rows unused)."""
    import gguf
    from hf_model_files import finish_gguf, gguf_writer_like_llama_cpp
    from test_model_gguf import llama_cpp_permute, llama_cpp_tensor_name

    cfg = model.config
    w = gguf_writer_like_llama_cpp(path, cfg, "llama", cfg.hidden_size // cfg.num_attention_heads)
    for name, t in model.state_dict().items():
        if "q_proj" in name or "k_proj" in name:
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = torch.from_numpy(llama_cpp_permute(t.float().numpy(), heads)).to(t.dtype)
        if t.ndim == 2 and dtype == torch.bfloat16:
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view("uint8")
            w.add_tensor(
                llama_cpp_tensor_name(name), bits, raw_dtype=gguf.GGMLQuantizationType.BF16
            )
        else:
            w.add_tensor(llama_cpp_tensor_name(name), t.float().numpy())
    finish_gguf(w)


def test_cpu_16_bit_checkpoint_engine(capsys, tmp_path, monkeypatch):
    """The engine on a bf16 checkpoint (its projections and embedding kept 16-bit) against its
    fp32 copy, as HF folders and as BF16 / F32 GGUF files: the same greedy tokens, rounds
    interleaved."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from hf_model_files import write_tokenizer

    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))

    torch.set_num_threads(THREADS)
    config = transformers.LlamaConfig(
        max_position_embeddings=2048, tie_word_embeddings=True, **CHECKPOINT
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    folders = {"bf16": tmp_path / "bf16", "fp32": tmp_path / "fp32"}
    model.save_pretrained(folders["bf16"], safe_serialization=True)
    model.float().save_pretrained(folders["fp32"], safe_serialization=True)
    for folder in folders.values():
        write_tokenizer(folder)
    folders["gguf bf16"], folders["gguf f32"] = tmp_path / "bf16.gguf", tmp_path / "f32.gguf"
    _write_gguf(folders["gguf bf16"], model, torch.bfloat16)
    _write_gguf(folders["gguf f32"], model.float(), torch.float32)
    rates = {name: [] for name in folders}
    for _ in range(3 if FULL else 1):
        for name, folder in folders.items():
            rates[name].append(_checkpoint_rates(folder))
    assert rates["bf16"][0][3] == rates["fp32"][0][3]  # the same greedy tokens
    assert rates["gguf bf16"][0][3] == rates["gguf f32"][0][3]
    best = {n: [max(r[i] for r in runs) for i in range(3)] for n, runs in rates.items()}
    with capsys.disabled():
        shape = f"Llama {CHECKPOINT['hidden_size']} x {CHECKPOINT['num_hidden_layers']} layers"
        rounds = len(rates["bf16"])
        print(f"\n{shape}, CPU backend, {THREADS} thread(s); tokens/s (best of {rounds})")
        head = f"{'prefill ' + str(PREFILL):>12s} {'decode x1':>10s} {'decode x16':>10s}"
        print(f"  {'weights':13s} {'MiB':>6s} {head}")
        for name, (p, one, many) in best.items():
            print(f"  {name:13s} {rates[name][0][4]:6.0f} {p:12.1f} {one:10.1f} {many:10.1f}")
        for half, full in (("bf16", "fp32"), ("gguf bf16", "gguf f32")):
            ratio = [a / b for a, b in zip(best[half], best[full], strict=True)]
            label = f"{half}/{full.split()[-1]}"
            print(f"  {label:13s} {'':6s} {ratio[0]:11.2f}x {ratio[1]:9.2f}x {ratio[2]:9.2f}x")
