"""The KV budget on a GPU, on the CPU: the device's memory comes from a faked source (the
torch.cuda calls kv_budget reads), with the numbers of the first GPU run's refused allocation;
a refused allocation is a clear error; closing an engine gives its memory back."""

from __future__ import annotations

import pytest
import torch

from pagedkern.engine import Engine, EngineConfig, kv_budget
from pagedkern.engine.kv_budget import DeviceMemory, KVCacheMemoryError, kv_budget_bytes
from pagedkern.model import kv_block_bytes
from pagedkern.model.config import PRESETS

GIB = 2**30


class FakeCudaMemory:
    """What torch.cuda reports about one device's memory, settable by the test."""

    def __init__(self, monkeypatch, free, total, reserved, allocated, peak):
        self.free, self.total, self.reserved, self.allocated = free, total, reserved, allocated
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (self.free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(kv_budget, "profile_peak_bytes", lambda *a: peak)


class FakeModel:
    """What kv_cache_blocks and allocate_kv_cache read of a model on a CUDA device."""

    def __init__(self, preset="seed", refuse=False):
        self.config = PRESETS[preset]
        self.kv_dtype = torch.bfloat16
        self.device = torch.device("cuda", 0)
        self.refuse = refuse

    def allocate_kv_cache(self, num_blocks, block_size):
        if self.refuse:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        raise AssertionError("not reached")


# The first H200 run: the 8B-shaped engine after another engine had closed (by garbage
# collection): 139.80 GiB, 27.41 GiB free, 14.66 GiB in tensors (the new weights) and 96.95 GiB
# reserved by the caching allocator but unused (the old engine's segments, split around the new
# weights: they cannot be given back). It asked for 96.03 GiB of KV.
H200 = dict(
    free=int(27.41 * GIB),
    total=int(139.80 * GIB),
    reserved=int((14.66 + 96.95) * GIB),
    allocated=int(14.66 * GIB),
    peak=int(16.0 * GIB),  # weights + a step's activations and logits
)


def test_the_budget_is_what_the_device_can_hand_out_not_the_fraction(monkeypatch):
    FakeCudaMemory(monkeypatch, **H200)
    model = FakeModel()
    config = EngineConfig(model="synthetic:seed", gpu_memory_fraction=0.8)
    blocks = kv_budget.kv_cache_blocks(model, config, 8192)
    cache = blocks * kv_block_bytes(model.config, config.block_size, model.kv_dtype)
    # the fraction alone allowed 0.8 x 139.80 - 16 = 95.8 GiB; the driver had 27.41 GiB
    assert 27 * GIB < cache <= H200["free"]


def test_budget_arithmetic():
    def memory(free, total, reserved, allocated):
        return DeviceMemory(int(free * GIB), int(total * GIB), int(reserved * GIB),
                            int(allocated * GIB))  # fmt: skip

    # a fresh device (weights 15, activations 2 in a 140 GiB device): the fraction binds
    fresh = memory(free=124, total=140, reserved=15, allocated=15)
    assert kv_budget_bytes(fresh, 17 * GIB, 0.9) == int(140 * 0.9 * GIB) - 17 * GIB
    # cached blocks (3 GiB unused) hold the activations: all the free memory is the cache's
    cached = memory(free=50, total=140, reserved=18, allocated=15)
    assert kv_budget_bytes(cached, 17 * GIB, 0.9) == 50 * GIB
    # ... or only a part of them: the rest comes from the free memory
    some = memory(free=50, total=140, reserved=16, allocated=15)
    assert kv_budget_bytes(some, 18 * GIB, 0.9) == 50 * GIB - 2 * GIB
    # another process holds most of the device: the free memory binds, the fraction does not
    shared = memory(free=20, total=140, reserved=15, allocated=15)
    assert kv_budget_bytes(shared, 17 * GIB, 0.9) == 18 * GIB
    # nothing left: negative
    assert kv_budget_bytes(memory(1, 140, 15, 15), 17 * GIB, 0.9) < 0
    assert memory(1, 2, 3, 5).cached == 0


def test_no_room_for_one_block_names_the_sizes(monkeypatch):
    FakeCudaMemory(monkeypatch, **{**H200, "free": 2**20})
    with pytest.raises(KVCacheMemoryError) as info:
        kv_budget.kv_cache_blocks(FakeModel(), EngineConfig(model="synthetic:seed"), 8192)
    message = str(info.value)
    assert "no memory for even one KV block (2097152 bytes" in message
    assert "0.00 GiB free of 139.80 GiB" in message and "96.95 GiB reserved" in message


def test_a_refused_allocation_is_a_clear_error(monkeypatch):
    FakeCudaMemory(monkeypatch, **H200)
    with pytest.raises(KVCacheMemoryError) as info:
        kv_budget.allocate_kv_cache(FakeModel(refuse=True), 49165, 16)
    message = str(info.value)
    assert message.startswith("the KV cache of 49165 blocks x 16 tokens (96.03 GiB) does not fit")
    assert "27.41 GiB free of 139.80 GiB" in message
    assert "96.95 GiB reserved by PyTorch's caching allocator but unused" in message
    assert "LLM.close()" in message
    assert info.value.__cause__ is None
    assert info.value.__context__ is None  # no out-of-memory traceback chained


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _close_as_on_a_gpu(engine, monkeypatch):
    """Engine.close() takes its GPU branch on a CPU engine (the memory calls are no-ops)."""
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    engine.model.device = torch.device("cuda", 0)
    engine.close()


def test_closing_an_engine_frees_its_cache_and_the_weights_it_loaded(monkeypatch):
    engine = Engine.from_config(
        EngineConfig(model="synthetic:tiny", backend="reference", device="cpu", kv_cache_gib=2**-8)
    )
    kv, weights = engine.kv_cache.data, engine.model.weights
    assert _storage_bytes(kv) > 0 and _storage_bytes(weights.layers[0].qkv) > 0
    _close_as_on_a_gpu(engine, monkeypatch)
    assert _storage_bytes(kv) == 0
    assert _storage_bytes(weights.embed) == 0 and _storage_bytes(weights.lm_head) == 0
    assert all(_storage_bytes(layer.down) == 0 for layer in weights.layers)
    assert _storage_bytes(engine.model.cos_sin) == 0
    _close_as_on_a_gpu(engine, monkeypatch)  # idempotent


def test_closing_an_engine_keeps_a_model_it_was_given(monkeypatch):
    first = Engine.from_config(
        EngineConfig(model="synthetic:tiny", backend="reference", device="cpu", kv_cache_gib=2**-8)
    )
    engine = Engine(first.model, first.tokenizer, first.config)
    kv = engine.kv_cache.data
    _close_as_on_a_gpu(engine, monkeypatch)
    assert _storage_bytes(kv) == 0
    assert _storage_bytes(first.model.weights.layers[0].qkv) > 0  # first's, still in use
