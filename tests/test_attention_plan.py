"""Plan/run attention (ops/attention_plan.py): per layer, run() equals the one-shot op with the
same arguments, on the CPU reference and on the emulated decode kernels (bit for bit, split-KV
too, without the one-shot op's host path); the launch parameters a plan fixes are exactly those the
one-shot op passes the extension (checked with a recording stub, decode and prefill, fp8 too);
a layer tensor of another layout is a ValueError, never a launch."""

from __future__ import annotations

import importlib

import pytest
import torch
from emulator import emulated, launches, unavailable_reason

import pagedkern
from pagedkern.ops.attention_plan import DecodeAttention, PrefillAttention

LAYERS = 3


def _decode_case(dtype, batch=3, hq=8, hkv=2, d=64, bs=16, lens=(70, 1, 300), seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens) + 1
    blocks = batch * width + 1
    table = torch.randperm(blocks - 1, generator=g)[: batch * width].view(batch, width) + 1
    caches = [
        [(torch.randn(blocks, hkv, bs, d, generator=g)).to(dtype) for _ in range(2)]
        for _ in range(LAYERS)
    ]
    qs = [torch.randn(batch, hq, d, generator=g).to(dtype) for _ in range(LAYERS)]
    return qs, caches, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _prefill_case(dtype, hq=8, hkv=2, d=64, bs=16, chunks=(5, 1, 40), lens=(20, 9, 40), seed=1):
    g = torch.Generator().manual_seed(seed)
    batch = len(chunks)
    width = max(-(-n // bs) for n in lens)
    blocks = batch * width + 2
    table = torch.randperm(blocks, generator=g)[: batch * width].view(batch, width)
    caches = [
        [torch.randn(blocks, hkv, bs, d, generator=g).to(dtype) for _ in range(2)]
        for _ in range(LAYERS)
    ]
    total = sum(chunks)
    qs = [torch.randn(total, hq, d, generator=g).to(dtype) for _ in range(LAYERS)]
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return qs, caches, cu, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def test_decode_runs_equal_the_one_shot_op_on_the_reference():
    qs, caches, table, lens = _decode_case(torch.float32)
    out = torch.empty_like(qs[0])
    plan = DecodeAttention()
    plan.plan(qs[0], *caches[0], table, lens, out, scale=0.2)
    for q, (k, v) in zip(qs, caches, strict=True):
        got = plan.run(q, k, v, out).clone()
        want = pagedkern.paged_attention(q, k, v, table, lens, 0.2)
        assert torch.equal(got, want)


def test_prefill_runs_equal_the_one_shot_op_on_the_reference():
    qs, caches, cu, table, lens = _prefill_case(torch.float32)
    out = torch.empty_like(qs[0])
    plan = PrefillAttention()
    plan.plan(qs[0], *caches[0], cu, table, lens, out)
    for q, (k, v) in zip(qs, caches, strict=True):
        got = plan.run(q, k, v, out).clone()
        assert torch.equal(got, pagedkern.flash_prefill(q, k, v, cu, table, lens))


def test_run_before_plan_is_an_error():
    with pytest.raises(RuntimeError, match="before plan"):
        DecodeAttention().run(None, None, None, None)


needs_emulator = pytest.mark.skipif(
    unavailable_reason() is not None, reason=str(unavailable_reason())
)


@needs_emulator
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_runs_on_the_emulated_kernels_bit_for_bit(monkeypatch, dtype, num_splits):
    qs, caches, table, lens = _decode_case(dtype)
    out = torch.full_like(qs[0], float("nan"))
    plan = DecodeAttention()
    with emulated():
        plan.plan(qs[0], *caches[0], table, lens, out, num_splits=num_splits)
        assert plan._launch is not None, "the kernel path was planned"
        wants = [
            pagedkern.paged_attention(q, k, v, table, lens, num_splits=num_splits)
            for q, (k, v) in zip(qs, caches, strict=True)
        ]
        plan_module = importlib.import_module("pagedkern.ops.attention_plan")

        def one_shot(*args, **kwargs):
            raise AssertionError("run took the one-shot op's path")

        monkeypatch.setattr(plan_module, "paged_attention_op", one_shot)
        before = launches()
        for q, (k, v), want in zip(qs, caches, wants, strict=True):
            out.fill_(float("nan"))
            assert torch.equal(plan.run(q, k, v, out), want)
        assert launches() - before == LAYERS * (2 if num_splits else 1)  # merge kernel


@needs_emulator
def test_a_layer_of_another_layout_is_refused_before_any_launch():
    qs, caches, table, lens = _decode_case(torch.float16)
    out = torch.empty_like(qs[0])
    plan = DecodeAttention()
    with emulated():
        plan.plan(qs[0], *caches[0], table, lens, out)
        plan.run(qs[0], *caches[0], out)
        before = launches()
        with pytest.raises(ValueError, match="k_cache"):
            plan.run(qs[1], caches[1][0][:-1], caches[1][1], out)
        with pytest.raises(ValueError, match="q"):
            plan.run(qs[1].float(), *caches[1], out)
        with pytest.raises(ValueError, match="out"):
            plan.run(qs[1], *caches[1], torch.empty_like(out)[:, :4])
        assert launches() == before


class RecordingExtension:
    """The parts of pagedkern._C the host paths call; launches record their arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        ext = self

        class Launch:
            def __init__(self, **kwargs) -> None:
                self.kwargs = kwargs

            def run(self, *, q, out, k_cache, v_cache, lse, stream):
                names = {"q": q, "out": out, "k_cache": k_cache, "v_cache": v_cache}
                ext.calls.append(("run", {**self.kwargs, **names, "lse": lse, "stream": stream}))
                return 1

        self.PagedAttentionLaunch = self.FlashPrefillLaunch = Launch

    def pointer_device(self, *, address):
        return 0

    def multiprocessor_count(self, *, device):
        return 132

    def flash_prefill_workspace_ints(self, *, total_q, batch):
        return 64 + total_q + batch

    def paged_attention(self, **kwargs):
        self.calls.append(("op", kwargs))

    def flash_prefill(self, **kwargs):
        self.calls.append(("op", kwargs))
        return 1


@pytest.fixture
def recording(monkeypatch) -> RecordingExtension:
    ext = RecordingExtension()
    launch = importlib.import_module("pagedkern.ops.launch")
    monkeypatch.setattr(launch, "require", lambda: ext)
    monkeypatch.setattr(launch, "current_stream", lambda views, device, stream=None: 0)
    monkeypatch.setattr(launch, "use_reference", lambda views: False)
    launch.sm_count.cache_clear()
    with launch.use_backend("cuda"):
        yield ext
    launch.sm_count.cache_clear()


def _same_launch(ext: RecordingExtension) -> None:
    (kind_a, op), (kind_b, run) = ext.calls
    assert (kind_a, kind_b) == ("op", "run")
    assert op.keys() == run.keys()
    differ = {k for k in op if op[k] != run[k]}
    assert differ <= {"workspace"}, differ  # (each allocates its own)


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_a_decode_plan_launches_what_the_one_shot_op_launches(recording, num_splits, fp8):
    qs, caches, table, lens = _decode_case(torch.bfloat16, lens=(1000, 3, 2000))
    k, v = caches[0]
    scales = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = {"k_scale": 0.5, "v_scale": 2.0}
    out = torch.empty_like(qs[0])
    pagedkern.paged_attention(qs[0], k, v, table, lens, 0.3, out, num_splits=num_splits, **scales)
    plan = DecodeAttention()
    plan.plan(qs[0], k, v, table, lens, out, scale=0.3, num_splits=num_splits, **scales)
    plan.run(qs[0], k, v, out)
    _same_launch(recording)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_prefill_plan_launches_what_the_one_shot_op_launches(recording, fp8):
    qs, caches, cu, table, lens = _prefill_case(torch.float16)
    k, v = caches[0]
    scales = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = {"k_scale": 0.25, "v_scale": 3.0}
    out = torch.empty_like(qs[0])
    pagedkern.flash_prefill(qs[0], k, v, cu, table, lens, None, out, **scales)
    plan = PrefillAttention()
    plan.plan(qs[0], k, v, cu, table, lens, out, **scales)
    plan.run(qs[0], k, v, out)
    _same_launch(recording)
    assert plan.path == "sm80"
