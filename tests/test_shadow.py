"""Shadow mode (ops/shadow.py): inside an engine's forward every compared op also runs its PyTorch
reference on copies of its inputs. On the CPU the op is the reference, so a correct run reports
no divergence, and an injected fault (a wrong scale in one layer's op) must be named by step,
layer and op; strict mode stops there. Off, the ops are the plain functions."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from test_engine import TINY, make_engine

import pagedkern.ops as ops
from pagedkern.engine import LLM, Engine, EngineConfig, SamplingParams, ShadowDivergence
from pagedkern.ops import shadow

PROMPT = list(range(3, 30))
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _run(engine, prompt=PROMPT, params=GREEDY) -> list[int]:
    engine.add_request(prompt_ids=prompt, params=params)
    ids = [t for out in engine.run_until_done() for t in out.token_ids]
    assert engine.pool.num_used == 0
    return ids


def test_a_correct_run_reports_every_op_and_no_divergence():
    plain = _run(make_engine())
    engine = make_engine(shadow="on")
    assert _run(engine) == plain, "shadow mode changes nothing the engine computes"
    report = engine.shadow
    assert report.first is None
    layers = engine.model.config.num_layers
    ops_seen = {op for op, _ in report.stats}
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache"} <= ops_seen
    assert {"flash_prefill", "paged_attention"} <= ops_seen
    assert {layer for _, layer in report.stats} == set(range(layers))
    assert report.stats[("silu_and_mul", 1)].calls == 6  # one prefill + five decode steps
    assert "no divergence" in report.summary()


def test_the_ops_are_the_plain_functions_outside_a_shadowed_forward():
    plain = ops.rms_norm
    engine = make_engine(shadow="on")
    _run(engine)
    assert ops.rms_norm is plain and not hasattr(ops.rms_norm, "__wrapped_op__")


def _faulty(monkeypatch, name: str, wrong):
    """Replace ops.<name> by a version that `wrong(args, result)` corrupts where it wants."""
    real = getattr(ops, name)

    @functools.wraps(real)
    def op(*args, **kwargs):
        result = real(*args, **kwargs)
        wrong(args, kwargs, result)
        return result

    monkeypatch.setattr(ops, name, op)


def test_a_wrong_scale_in_one_layer_is_named_by_step_layer_and_op(monkeypatch):
    engine = make_engine(shadow="on")
    target = engine.model.weights.layers[1].post_norm

    def wrong(args, kwargs, result):
        if args[2] is target and engine.iteration >= 3:  # layer 1, from the third step on
            result[0].mul_(1.05)

    _faulty(monkeypatch, "fused_add_rms_norm", wrong)
    _run(engine)
    first = engine.shadow.first
    assert (first.step, first.layer, first.op) == (3, 1, "fused_add_rms_norm")
    assert first.error > first.tolerance
    summary = engine.shadow.summary()
    assert "step 3, layer 1, fused_add_rms_norm" in summary
    stats = engine.shadow.stats
    assert stats[("fused_add_rms_norm", 1)].divergences > 0
    assert stats[("fused_add_rms_norm", 0)].divergences == 0
    assert all(s.divergences == 0 for (op, _), s in stats.items() if op != "fused_add_rms_norm")


def test_a_bad_kv_cache_write_is_found_in_the_cache_rows(monkeypatch):
    engine = make_engine(shadow="on")
    first_layer_cache = engine.kv_cache.layers[0][1]

    def wrong(args, kwargs, result):
        v_cache, slots = args[6], args[7]
        if v_cache is first_layer_cache:
            at = slots[-1].item()
            bs = v_cache.shape[2]
            v_cache[at // bs, :, at % bs] += 1.0

    _faulty(monkeypatch, "rope_and_cache", wrong)
    _run(engine)
    first = engine.shadow.first
    assert (first.step, first.layer, first.op) == (1, 0, "rope_and_cache")
    assert first.row == len(PROMPT) - 1  # the last token's row


def test_strict_mode_stops_at_the_first_divergence_and_frees_the_blocks(monkeypatch):
    engine = make_engine(shadow="strict")
    target = engine.model.weights.layers[0].input_norm

    def wrong(args, kwargs, result):
        if args[1] is target:
            result.mul_(0.5)

    _faulty(monkeypatch, "rms_norm", wrong)
    engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    with pytest.raises(ShadowDivergence, match="step 1, layer 0, rms_norm"):
        engine.step()
    assert not engine.has_unfinished and engine.pool.num_used == 0
    assert ops.rms_norm.__name__ == "rms_norm" and not hasattr(ops.rms_norm, "__wrapped_op__")


def test_quantized_weights_are_checked_too():
    engine = make_engine(shadow="on", quantization="int8")
    _run(engine)
    calls = sum(s.calls for (op, _), s in engine.shadow.stats.items() if op == "quant_linear")
    assert calls > 0 and engine.shadow.first is None


def test_llm_and_the_environment_switch_it_on(monkeypatch):
    with LLM(TINY, backend="reference", num_blocks=64, block_size=4, shadow=True) as llm:
        assert llm.engine.shadow is not None and not llm.engine.shadow.strict
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    monkeypatch.setenv("PAGEDKERN_SHADOW", "strict")
    assert make_engine().shadow.strict
    monkeypatch.setenv("PAGEDKERN_SHADOW", "0")
    assert make_engine().shadow is None
    with pytest.raises(ValueError, match="shadow"):
        make_engine(shadow="loud")


def test_relative_error_finds_the_first_bad_row_and_nan():
    ref = torch.ones(4, 3)
    out = ref.clone()
    out[2] *= 1.1
    error, row = shadow._relative_error(out, ref, 1e-2)
    assert row == 2 and error == pytest.approx(0.1)
    out = ref.clone()
    out[1, 0] = float("nan")
    assert shadow._relative_error(out, ref, 1e-2)[1] == 1


def test_the_cli_prints_the_report():
    cli = [sys.executable, "-m", "pagedkern.serving.cli", "--model", TINY]
    proc = subprocess.run(
        [*cli, "--backend", "reference", "--shadow", "--max-tokens", "3", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "shadow mode" in proc.stderr and "no divergence" in proc.stderr
    assert "paged_attention:" in proc.stderr


SHARED = list(range(100, 140))  # a 40-token prefix the later prompts share


def serve_strict(model: str, backend: str, dtype: str, kv_cache_dtype: str):
    """A few requests (chunked prefill, prefix-cache hits, decode) on an engine in strict
    shadow mode; its report, after checking that every request finished without error and the
    main ops were all compared (the GPU stage runs this on the kernels)."""
    config = EngineConfig(
        model=model,
        dtype=dtype,
        backend=backend,
        num_blocks=512,
        max_num_batched_tokens=96,  # a 200-token prompt prefills in chunks
        kv_cache_dtype=kv_cache_dtype,
        shadow="strict",
    )
    engine = Engine.from_config(config)
    try:
        prompts = [SHARED + [7] * 160, SHARED + [9, 10, 11], [5] * 37, SHARED + [12]]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for ids in prompts:
            engine.add_request(prompt_ids=ids, params=params)
        outputs = [o for o in engine.run_until_done() if o.finished]
        assert len(outputs) == len(prompts)
        assert all(o.error is None for o in outputs)
        assert engine.pool.num_used == 0
    finally:
        engine.close()
    report = engine.shadow
    assert report.first is None
    seen = {op for op, _ in report.stats}
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache"} <= seen
    assert {"flash_prefill", "paged_attention"} <= seen
    return report


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "bfloat16"])
def test_the_gpu_stage_runs_here_on_the_reference(kv_cache_dtype):
    """The shadow stage's own code path on the CPU: a failure a CPU can show never waits for
    a GPU."""
    report = serve_strict(TINY, "reference", "float32", kv_cache_dtype)
    assert "no divergence" in report.summary()


def test_the_http_server_reports_shadow_mode_in_metrics():
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from support.serving import ServerThread

    with ServerThread(make_engine(shadow="on")) as server:
        body = {"model": TINY, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics", timeout=60).text
    lines = [line for line in text.splitlines() if line.startswith("pagedkern_shadow_")]
    calls = [line for line in lines if line.startswith("pagedkern_shadow_calls_total")]
    assert any('{op="rms_norm",layer="0"}' in line for line in calls)
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in calls)
    errors = [line for line in lines if line.startswith("pagedkern_shadow_max_relative_error")]
    assert errors and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in errors)


@pytest.mark.parametrize("head_dim", [64, 30])
def test_qk_norm_in_rope_and_cache_is_checked_with_the_norm(head_dim):
    """The op normalises q and k's heads before rotating them (Qwen3, Gemma 3, OLMoE): the shadow
    reference must too, or every such layer reports a divergence."""
    torch.manual_seed(0)
    tokens, hq, hkv, blocks, bs = 5, 4, 2, 3, 4
    q = torch.randn(tokens, hq, head_dim) * 3
    k = torch.randn(tokens, hkv, head_dim) * 3
    v = torch.randn(tokens, hkv, head_dim)
    cache = torch.zeros(blocks, hkv, bs, head_dim)
    from pagedkern.reference import cos_sin_cache

    cos_sin = cos_sin_cache(head_dim, 16)
    positions = torch.arange(tokens, dtype=torch.int32)
    slots = torch.tensor([0, 1, -1, 5, 9], dtype=torch.int32)
    q_norm, k_norm = torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5
    report = shadow.ShadowReport()
    with report.active(step=0):
        ops.rope_and_cache(
            q, k, v, positions, cos_sin, cache, cache.clone(), slots, q_norm=q_norm, k_norm=k_norm
        )
    assert report.stats[("rope_and_cache", None)].calls == 1
    assert report.first is None, report.summary()
