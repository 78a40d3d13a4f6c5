"""The model's attention through plan/run (model/step_attention.py): one plan per kind of layer
per step, every layer a run. On the CPU reference the forward is bit-equal to the one-shot ops
(PAGEDKERN_KERNELS=attention_plan:off), a sliding/global model planning two kinds; on the
emulated decode kernels likewise, with no layer reaching the one-shot op; on the kernel path
(extension stubbed) a run after the plan does no torch work but views, allocates nothing and
never plans; a plan inside a CUDA-graph capture is refused; the decode graphs' static path
plans each batch size once and runs it for every later step."""

from __future__ import annotations

import importlib

import pytest
import torch
from emulator import emulated, launches, unavailable_reason
from mixed_batches import mixed_batch
from test_attention_plan import RecordingExtension, recording  # noqa: F401 - a fixture
from torch.utils._python_dispatch import TorchDispatchMode

from pagedkern.engine.cuda_graphs import DecodeGraphs
from pagedkern.model import layout_batch, load_model
from pagedkern.model.config import FULL, PRESETS, SLIDING
from pagedkern.model.step_attention import StepAttention
from pagedkern.ops import launch
from pagedkern.ops.attention_plan import DecodeAttention, PrefillAttention
from pagedkern.ops.variants import use_kernels

BLOCK = 16
plan_module = importlib.import_module("pagedkern.ops.attention_plan")

# tiny, with D = 64 (the decode kernel's smallest) and a sliding layer beside a global one,
# soft-capped: two kinds of plan, every attention option of the model passed through
HYBRID = PRESETS["tiny"].replace(
    name="tiny-hybrid",
    head_dim=64,
    sliding_window=24,
    layer_types=(SLIDING, FULL, SLIDING),
    num_layers=3,
    attn_soft_cap=30.0,
)


def _model(config, dtype=torch.float32):
    return load_model(config, "cpu", dtype)[0]


def _cache(model, seed: int = 3):
    kv = model.allocate_kv_cache(64, BLOCK)
    g = torch.Generator().manual_seed(seed)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g).to(kv.data.dtype))
    return kv


def _forward_both_ways(model, chunks):
    """(logits, cache) through plan/run and through the one-shot ops, from the same cache."""
    layout = layout_batch(chunks, BLOCK)
    planned_kv, one_shot_kv = _cache(model), _cache(model)
    planned = model(*layout.upload(), planned_kv)
    with use_kernels(attention_plan="off"):
        one_shot = model(*layout.upload(), one_shot_kv)
    return (planned, planned_kv.data), (one_shot, one_shot_kv.data)


@pytest.mark.parametrize("config", [PRESETS["tiny"], HYBRID], ids=["tiny", "hybrid"])
@pytest.mark.parametrize("decodes_only", [False, True])
def test_planned_forward_equals_the_one_shot_ops_on_the_reference(config, decodes_only):
    model = _model(config)
    prefills = [] if decodes_only else [9, 30]
    chunks = mixed_batch(5, prefills, 4, BLOCK, vocab=512, max_prefix=60)
    (planned, planned_kv), (one_shot, one_shot_kv) = _forward_both_ways(model, chunks)
    assert not planned.isnan().any()
    assert torch.equal(planned, one_shot)
    assert torch.equal(planned_kv, one_shot_kv)


def test_one_plan_per_kind_of_layer(monkeypatch):
    plans = []
    real_init = StepAttention.__init__

    def init(self, meta, *args):
        real_init(self, meta, *args)
        plans.append(self)

    monkeypatch.setattr(StepAttention, "__init__", init)
    for config, kinds in ((PRESETS["tiny"], 1), (HYBRID, 2)):
        model = _model(config)
        layout = layout_batch(mixed_batch(1, [5], 2, BLOCK, 512, 40), BLOCK)
        plans.clear()
        model(*layout.upload(), _cache(model))
        assert len(plans) == 1 and plans[0].num_plans == kinds


needs_emulator = pytest.mark.skipif(
    unavailable_reason() is not None, reason=str(unavailable_reason())
)


@needs_emulator
def test_a_decode_step_on_the_emulated_kernels_is_bit_equal_and_only_runs(monkeypatch):
    model = _model(HYBRID, torch.float16)
    layout = layout_batch(mixed_batch(2, [], 3, BLOCK, vocab=512, max_prefix=90), BLOCK)
    with emulated():
        with use_kernels(attention_plan="off"):
            one_shot_kv = _cache(model)
            before = launches()
            want = model(*layout.upload(), one_shot_kv)
            one_shot_launches = launches() - before

        def refused(*args, **kwargs):
            raise AssertionError("a layer ran the one-shot op")

        monkeypatch.setattr(plan_module, "paged_attention_op", refused)
        planned_kv = _cache(model)
        before = launches()
        got = model(*layout.upload(), planned_kv)
        assert launches() - before == one_shot_launches
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(planned_kv.data, one_shot_kv.data)


class OpRecorder(TorchDispatchMode):
    """Every torch op dispatched inside the block (factory functions included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_run_after_the_plan_allocates_nothing_and_plans_nothing(recording, monkeypatch):  # noqa: F811
    layout = layout_batch(mixed_batch(4, [7, 3], 3, BLOCK, vocab=512, max_prefix=40), BLOCK)
    _, meta = layout.upload()
    tokens, heads, kv_heads, dim = meta.num_tokens, 8, 2, 64
    g = torch.Generator().manual_seed(0)

    def layer():  # q as the model's: a view into a fused QKV output
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).half()
        caches = [torch.randn(40, kv_heads, BLOCK, dim, generator=g).half() for _ in range(2)]
        return qkv[:, : heads * dim].view(tokens, heads, dim), *caches

    out = torch.empty(tokens, heads, dim, dtype=torch.float16)
    attention = StepAttention(meta)
    options = dict(scale=0.125, sliding_window=20, soft_cap=30.0)
    attention(*layer(), out, **options)  # the first layer plans
    assert [kind for kind, _ in recording.calls] == ["run", "run"]  # prefill, then decode
    for cls in (DecodeAttention, PrefillAttention):
        monkeypatch.setattr(cls, "plan", lambda *a, **k: pytest.fail("planned again"))
    recorder = OpRecorder()
    for _ in range(3):
        q, k, v = layer()
        with recorder, launch.count_launches() as counted:
            attention(q, k, v, out, **options)
        assert set(recorder.ops) <= {"aten.slice.Tensor"}, recorder.ops  # views of q and out
        assert counted == {"flash_prefill": 1, "paged_attention": 1}
        assert recording.calls[-1][1]["q"] == q[meta.num_prefill_tokens :].data_ptr()
    assert len(recording.calls) == 2 + 3 * 2
    assert attention.num_plans == 1


def test_a_decode_only_run_does_no_torch_work_at_all(recording):  # noqa: F811
    layout = layout_batch(mixed_batch(4, [], 5, BLOCK, vocab=512, max_prefix=40), BLOCK)
    _, meta = layout.upload()
    q = torch.randn(meta.num_tokens, 8, 64).half()
    cache = torch.randn(40, 2, BLOCK, 64).half()
    out = torch.empty_like(q)
    attention = StepAttention(meta)
    attention(q, cache, cache, out)
    recorder = OpRecorder()
    with recorder:
        attention(q, cache, cache, out)
    assert recorder.ops == []
    assert [kind for kind, _ in recording.calls] == ["run", "run"]


def test_planning_inside_a_capture_is_refused():
    model = _model(PRESETS["tiny"])
    layout = layout_batch(mixed_batch(1, [], 2, BLOCK, 512, 40), BLOCK)
    ids, meta = layout.upload()
    attention = StepAttention(meta)
    attention.frozen = True
    with pytest.raises(RuntimeError, match="planned during a CUDA-graph capture"):
        model(ids, meta, _cache(model), attention)


@pytest.mark.parametrize("cpu_attention", ["tiles", "kernel"])
def test_decode_graphs_plan_each_size_once_and_run_it_every_step(
    monkeypatch, kernels, cpu_attention
):
    """The static path keeps one StepAttention a bucket, refilled in place each step: its rows
    follow the new metadata (the kernel's plan re-reads written metadata)."""
    kernels(cpu_attention=cpu_attention)
    model = _model(HYBRID)
    kv = _cache(model)
    graphs = DecodeGraphs(model, kv, max_num_seqs=8, max_model_len=256)
    planned = []
    real_plan = DecodeAttention.plan

    def plan(self, *args, **kwargs):
        planned.append(args[0].shape[0])
        return real_plan(self, *args, **kwargs)

    monkeypatch.setattr(DecodeAttention, "plan", plan)
    eager_kv = _cache(model)
    eager_kv.data.copy_(kv.data)
    for step in range(3):
        chunks = mixed_batch(10 + step, [], 3, BLOCK, vocab=512, max_prefix=100)
        layout = layout_batch(chunks, BLOCK)
        got = graphs.run(layout)  # bucket 4: the static path, eagerly on the CPU
        want = model(*layout.upload(), eager_kv)
        # to rounding: the static path's GEMMs have 4 rows (a padding row), the eager ones 3,
        # and a float32 BLAS GEMM may round a row by the rows beside it (an AMD EPYC's MKL does)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.data, eager_kv.data, rtol=1e-5, atol=1e-5)
    attention = graphs.static_step(4)[2]
    assert attention.num_plans == 2  # sliding and global layers
    # the static path's plans: two, at its first step (batch 4; its padding rows keep the CPU
    # backend's decode plan off); the eager forwards' sliding layers one a step (their global
    # layers: the CPU backend's own decode plan); the kernel plans every layer itself
    assert planned == ([4, 4] + [3] * 3 if cpu_attention == "tiles" else [])
