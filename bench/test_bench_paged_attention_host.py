"""Host cost of one paged_attention call: argument checks, split plan, the launch call, with the
extension stubbed (its launch is a no-op) and fake CUDA arrays, so it runs on any CPU, smoke mode
included. The kernel at B=1, L=32768 takes ~40 us on a GPU; the Python in front of it must stay
well below that (target < 15 us per call): views read each interface once, the structural checks
run once per layout (ops/arrays.py CheckedLayouts) and the plan is cached. Timed with
perf_counter over many calls (a GPU is not involved), median of rounds; the first call of each
case (plan and check cache misses) is reported apart."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest
from measure import per_call_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_cuda_array import FakeCudaArray  # noqa: E402

# The modules (pagedkern.ops re-exports functions of the same names).
launch_module = importlib.import_module("pagedkern.ops.launch")
pa_module = importlib.import_module("pagedkern.ops.paged_attention")

NUM_SMS = 132
# (batch, query heads, KV heads, head dim, block size, max_seq_len)
CASES = [(1, 32, 8, 128, 16, 32768), (64, 32, 8, 128, 16, 4096)]


class StubExtension:
    """Just what the op's host path calls on pagedkern._C; the launch records its arguments."""

    def __init__(self) -> None:
        self.launches = 0

    def pointer_device(self, *, address: int) -> int:
        return 0

    def multiprocessor_count(self, *, device: int) -> int:
        return NUM_SMS

    def paged_attention(self, *args, **kwargs) -> None:
        self.launches += 1


@pytest.fixture
def stub(monkeypatch) -> StubExtension:
    ext = StubExtension()
    monkeypatch.setattr(launch_module, "require", lambda: ext)
    # The kernel path whatever backend an earlier benchmark left selected (e2e: "reference").
    monkeypatch.setattr(launch_module, "_backend", "auto")
    launch_module.sm_count.cache_clear()
    monkeypatch.setattr(pa_module, "_CHECKED", pa_module.CheckedLayouts())
    return ext


@pytest.mark.parametrize("batch,hq,hkv,d,bs,max_len", CASES)
def test_paged_attention_host_cost(stub, record, smoke, batch, hq, hkv, d, bs, max_len):
    blocks = max_len // bs
    q = FakeCudaArray((batch, hq, d), "float16")
    out = FakeCudaArray((batch, hq, d), "float16")
    cache = FakeCudaArray((batch * blocks, hkv, bs, d), "float16")
    tables = FakeCudaArray((batch, blocks), "int32")
    lens = FakeCudaArray((batch,), "int32")
    plan = pa_module.plan_splits(batch, hq, hkv, d, max_len, NUM_SMS)
    need = pa_module.workspace_size(batch, hq, d, plan.num_splits)
    workspace = FakeCudaArray((max(need, 1),), "float32")

    def call():
        pa_module.paged_attention(
            q, cache, cache, tables, lens, out=out, max_seq_len=max_len, workspace=workspace
        )

    pa_module.plan_splits.cache_clear()
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    seconds = per_call_seconds(call, calls=20 if smoke else 2000, rounds=3 if smoke else 15)
    case = f"B={batch} L={max_len} Hq/Hkv={hq}/{hkv} D={d}"
    record("paged_attention host", case, "python per call", seconds, first_call_us=first * 1e6)
    assert stub.launches == 1 + (3 if smoke else 15) * (20 if smoke else 2000)
    # Every call after the first took its plan from the cache.
    assert pa_module.plan_splits.cache_info().misses == 1
    assert pa_module._CHECKED.misses == 2  # and its checks from the memo


class StubLaunch:
    runs = 0

    def __init__(self, **kwargs) -> None:
        pass

    def run(self, *, q, out, k_cache, v_cache, lse, stream) -> None:
        StubLaunch.runs += 1


@pytest.mark.parametrize("batch,hq,hkv,d,bs,max_len", CASES)
def test_plan_run_host_cost(stub, record, smoke, monkeypatch, batch, hq, hkv, d, bs, max_len):
    """DecodeAttention.run: the per-layer call of a plan (target < 5 us): layout check, four
    pointers, the launch. torch tensors (on the CPU here, the kernel path forced, the
    extension stubbed) since the fast path reads torch's own attributes."""
    import torch

    from pagedkern.ops.attention_plan import DecodeAttention

    stub.PagedAttentionLaunch = StubLaunch
    monkeypatch.setattr(launch_module, "use_reference", lambda views: False)
    monkeypatch.setattr(launch_module, "current_stream", lambda views, device, stream=None: 0)
    blocks = max_len // bs
    q = torch.empty(batch, hq, d, dtype=torch.float16)
    out = torch.empty_like(q)
    cache = torch.empty(batch * blocks + 1, hkv, bs, d, dtype=torch.float16)
    tables = torch.zeros(batch, blocks, dtype=torch.int32)
    lens = torch.full((batch,), max_len, dtype=torch.int32)
    plan = DecodeAttention()
    t0 = time.perf_counter()
    plan.plan(q, cache, cache, tables, lens, out, max_seq_len=max_len)
    planning = time.perf_counter() - t0
    StubLaunch.runs = 0
    seconds = per_call_seconds(
        lambda: plan.run(q, cache, cache, out, stream=0),
        calls=20 if smoke else 2000,
        rounds=3 if smoke else 15,
    )
    case = f"B={batch} L={max_len} Hq/Hkv={hq}/{hkv} D={d}"
    record("paged_attention host", case, "plan/run per run", seconds, plan_us=planning * 1e6)
    assert StubLaunch.runs == (3 if smoke else 15) * (20 if smoke else 2000)


# (decode rows, prefill chunk lengths) of a step; layers per step
STEP_CASES = [(64, ()), (62, (100, 100))]
STEP_LAYERS = 32


@pytest.mark.parametrize("decodes,prefills", STEP_CASES)
def test_step_attention_host_cost(stub, record, smoke, monkeypatch, decodes, prefills):
    """The engine's attention per step (model/step_attention.py): 32 layers through plan/run
    (one plan, 32 runs) against the one-shot ops (PAGEDKERN_KERNELS=attention_plan:off: 32
    planned calls), extension stubbed, torch CPU tensors on the kernel path, q a view into a
    fused QKV output as in the model. The two alternate round by round (the host is shared)."""
    import torch

    from pagedkern.model import SequenceChunk, layout_batch
    from pagedkern.model.step_attention import StepAttention

    stub.PagedAttentionLaunch = stub.FlashPrefillLaunch = StubLaunch
    stub.flash_prefill = lambda **kwargs: 1
    stub.flash_prefill_workspace_ints = lambda *, total_q, batch: 64 + total_q + batch
    monkeypatch.setattr(launch_module, "use_reference", lambda views: False)
    monkeypatch.setattr(launch_module, "current_stream", lambda views, device, stream=None: 0)
    # the kernel path's host cost: not the CPU backend's decode plan, which gathers the pages
    monkeypatch.setattr(StepAttention, "_on_cpu_backend", lambda self, k_cache: False)
    hq, hkv, d, bs, context = 32, 8, 128, 16, 2048
    width = context // bs
    chunks = [
        SequenceChunk([1] * n, context - n, list(range(i * width, (i + 1) * width)))
        for i, n in enumerate([*prefills, *[1] * decodes])
    ]
    _, meta = layout_batch(chunks, bs).upload()
    tokens = meta.num_tokens
    qkv = torch.empty(tokens, (hq + 2 * hkv) * d, dtype=torch.float16)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    out = torch.empty(tokens, hq, d, dtype=torch.float16)
    cache = torch.empty(len(chunks) * width + 1, hkv, bs, d, dtype=torch.float16)

    def step(one_shot: bool) -> None:
        attention = StepAttention(meta)
        attention.one_shot = one_shot
        for _ in range(STEP_LAYERS):
            attention(q, cache, cache, out, scale=d**-0.5)

    calls, rounds = (2, 3) if smoke else (20, 15)
    samples: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for one_shot in (True, False):
            t0 = time.perf_counter()
            for _ in range(calls):
                step(one_shot)
            samples[one_shot].append((time.perf_counter() - t0) / calls)
    one_shot_s, planned_s = (sorted(samples[k])[rounds // 2] for k in (True, False))
    case = f"{decodes} decodes + prefills {list(prefills)}, {STEP_LAYERS} layers"
    record("attention per step host", case, "one-shot ops", one_shot_s)
    record(
        "attention per step host", case, "plan/run", planned_s, vs_one_shot=planned_s / one_shot_s
    )
