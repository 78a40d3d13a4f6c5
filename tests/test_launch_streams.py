"""Which stream an op's own arrays are ordered on (host code, tested on the CPU).

An op launched on a stream other than the library's current one (a `stream=` argument, a side
stream) must fill its scalar parameters, allocate its outputs and per-call workspaces and run
its torch post-processing on that launch stream: a fill on another stream may land after the
kernel read it, and a workspace freed on return would go back to the caching allocator under
the other stream, free for its next allocation while the kernel still runs. Each op here runs
through its kernel path against a recording extension; every allocation and the launch record
the stream current at that moment."""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

import pagedkern
from pagedkern.ops.arrays import ArrayView

launch = importlib.import_module("pagedkern.ops.launch")
ops_sampling = importlib.import_module("pagedkern.ops.sampling")
ops_paged_attention = importlib.import_module("pagedkern.ops.paged_attention")
ops_flash_prefill = importlib.import_module("pagedkern.ops.flash_prefill")
ops_paged_kv = importlib.import_module("pagedkern.ops.paged_kv")
logits_processing = importlib.import_module("pagedkern.reference.logits_processing")

LAUNCH_STREAM = 0x5EED  # the caller's stream= handle
CURRENT = 0  # the library's current stream


class Streams:
    """The current stream as the ops see it: on_launch_stream switches it; every allocation,
    the kernel launch and the torch post-processing record it."""

    def __init__(self) -> None:
        self.current = CURRENT
        self.events: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def on_launch_stream(self, views, device, handle):
        saved, self.current = self.current, handle
        try:
            yield
        finally:
            self.current = saved

    def recorder(self, name, real):
        def record(*args, **kwargs):
            self.events.append((name, self.current))
            return real(*args, **kwargs)

        return record


class Extension:
    """The parts of pagedkern._C the ops call; launches record their stream argument."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def pointer_device(self, *, address):
        return 0

    def multiprocessor_count(self, *, device):
        return 132

    def flash_prefill_workspace_ints(self, *, total_q, batch):
        return 64 + total_q + batch

    def _launch(self, name, kwargs):
        assert kwargs["stream"] == LAUNCH_STREAM
        self.streams.events.append((name, kwargs["stream"]))

    def sample(self, **kwargs):
        self._launch("sample", kwargs)

    def paged_attention(self, **kwargs):
        self._launch("paged_attention", kwargs)

    def flash_prefill(self, **kwargs):
        self._launch("flash_prefill", kwargs)
        return 1


@pytest.fixture
def streams(monkeypatch) -> Streams:
    s = Streams()
    monkeypatch.setattr(launch, "require", lambda: Extension(s))
    monkeypatch.setattr(launch, "use_reference", lambda views: False)
    for module in (ops_sampling, ops_paged_attention, ops_flash_prefill):
        monkeypatch.setattr(module, "on_launch_stream", s.on_launch_stream)
    for module in (ops_sampling, ops_paged_kv):
        for name in ("empty_like", "full_like"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, s.recorder(name, getattr(module, name)))
    real = logits_processing.write_top_logprobs
    monkeypatch.setattr(logits_processing, "write_top_logprobs", s.recorder("top-N", real))
    launch.sm_count.cache_clear()
    yield s
    launch.sm_count.cache_clear()


def _all_on_the_launch_stream(events, launched: str, expected: set[str]) -> None:
    names = {name for name, _ in events}
    assert launched in names and expected <= names, events
    assert all(stream == LAUNCH_STREAM for _, stream in events), events


@pytest.mark.parametrize("variant", ["v4", "v3", "v2"])
def test_sample_fills_and_allocates_on_the_launch_stream(streams, kernels, variant):
    kernels(sample=variant)
    rows, vocab = 2, 8192
    logits = torch.randn(rows, vocab)
    processing = dict(
        token_offsets=torch.tensor([0, 1, 2], dtype=torch.int32),
        token_ids=torch.tensor([3, 4], dtype=torch.int32),
        token_counts=torch.tensor([1, 0], dtype=torch.int32),
        token_bias=torch.zeros(2),
        presence_penalty=torch.zeros(rows),
        frequency_penalty=torch.zeros(rows),
        repetition_penalty=torch.ones(rows),
    )
    # scalar parameters: five arrays filled per call; out and the entries' workspace allocated
    pagedkern.sample(logits, 0.8, 0.9, 20, 7, 3, stream=LAUNCH_STREAM, **processing)
    expected = {"full_like", "empty_like"}
    _all_on_the_launch_stream(streams.events, "sample", expected)
    assert [n for n, _ in streams.events].count("full_like") == 5
    if variant == "v4":  # two rows on 132 SMs: split, with its merge state allocated per call
        assert [n for n, _ in streams.events].count("empty_like") == 3
    streams.events.clear()
    top_ids, top = torch.zeros(rows, 5, dtype=torch.int32), torch.zeros(rows, 5)
    lp, out = torch.zeros(rows), torch.zeros(rows, dtype=torch.int32)  # (the stub writes none)
    pagedkern.sample(
        logits, 0.0, 1.0, 0, 7, 3, out, logprobs=lp, top_ids=top_ids, top_logprobs=top,
        stream=LAUNCH_STREAM,
    )  # fmt: skip
    _all_on_the_launch_stream(
        streams.events, "sample", {"full_like"} | ({"top-N"} if variant == "v2" else set())
    )


@pytest.mark.parametrize("num_splits", [None, 4])
def test_paged_attention_allocates_out_lse_and_workspace_on_the_launch_stream(streams, num_splits):
    batch, hq, hkv, d, bs = 3, 8, 2, 64, 16
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16)
    k = torch.randn(40, hkv, bs, d, dtype=torch.bfloat16)
    table = torch.arange(3 * 12, dtype=torch.int32).view(3, 12)
    lens = torch.tensor([100, 1, 190], dtype=torch.int32)
    pagedkern.paged_attention(
        q, k, k.clone(), table, lens, return_lse=True, max_seq_len=4096, num_splits=num_splits,
        stream=LAUNCH_STREAM,
    )  # fmt: skip
    allocations = [n for n, _ in streams.events if n == "empty_like"]
    assert len(allocations) == 3  # out, lse and (split or not: 4096 keys, 3 rows) the workspace
    _all_on_the_launch_stream(streams.events, "paged_attention", {"empty_like"})


def test_flash_prefill_allocates_out_lse_and_work_list_on_the_launch_stream(streams):
    hq, hkv, d, bs = 8, 2, 64, 16
    q = torch.randn(46, hq, d, dtype=torch.float16)
    k = torch.randn(20, hkv, bs, d, dtype=torch.float16)
    cu = torch.tensor([0, 5, 6, 46], dtype=torch.int32)
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    lens = torch.tensor([20, 9, 40], dtype=torch.int32)
    pagedkern.flash_prefill(q, k, k.clone(), cu, table, lens, return_lse=True, stream=LAUNCH_STREAM)
    assert [n for n, _ in streams.events].count("empty_like") == 3  # out, lse, work list
    _all_on_the_launch_stream(streams.events, "flash_prefill", {"empty_like"})


def _cuda_view(library: str) -> ArrayView:
    return ArrayView("x", None, 256, (4,), (1,), "float32", 0, library)


def test_on_launch_stream_makes_the_launch_stream_current_for_torch(monkeypatch):
    made, entered = [], []

    class External:
        def __init__(self, handle, device=None):
            made.append((handle, device))

    @contextlib.contextmanager
    def stream(s):
        entered.append(s)
        yield

    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=CURRENT)
    )
    monkeypatch.setattr(torch.cuda, "ExternalStream", External)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    views = [_cuda_view("torch")]
    with launch.on_launch_stream(views, 0, CURRENT):  # already current: nothing to switch
        pass
    assert made == [] and entered == []
    with launch.on_launch_stream(views, 0, LAUNCH_STREAM):
        assert made == [(LAUNCH_STREAM, 0)] and len(entered) == 1
    host = [ArrayView("x", None, 256, (4,), (1,), "float32", "cpu", "torch")]
    with launch.on_launch_stream(host, 0, LAUNCH_STREAM):  # host arrays have no streams
        assert len(made) == 1


def test_on_launch_stream_makes_the_launch_stream_current_for_cupy(monkeypatch):
    used = []

    class External:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            used.append(self.ptr)

        def __exit__(self, *exc):
            used.append("exit")

    cuda = SimpleNamespace(
        get_current_stream=lambda: SimpleNamespace(ptr=CURRENT), ExternalStream=External
    )
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda))
    views = [_cuda_view("cupy")]
    with launch.on_launch_stream(views, 0, CURRENT):
        pass
    assert used == []
    with launch.on_launch_stream(views, 0, LAUNCH_STREAM):
        assert used == [LAUNCH_STREAM]
    assert used == [LAUNCH_STREAM, "exit"]
