"""fp8 (E4M3) KV cache on the reference ops: the write quantizes within E4M3's spacing and
saturates instead of producing NaN; attention over the fp8 cache (scales folded into the
softmax scale and the output, as LlamaModel does) equals attention over the dequantized cache;
the engine sizes and runs an fp8 cache end to end (agreement: test_quant_end_to_end.py)."""

from __future__ import annotations

import math

import pytest
import torch

import pagedkern
from pagedkern import reference
from pagedkern.engine import LLM, SamplingParams
from pagedkern.model import load_model
from pagedkern.model.kv_cache import FP8, allocate_kv_cache
from pagedkern.reference import cos_sin_cache


def e4m3_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance between neighbouring E4M3 values around |x| (3 mantissa bits; subnormals
    below 2^-6 are spaced 2^-9)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2**-6)))
    return torch.exp2(exponent - 3)


def write(k, v, scale_k, scale_v, block_size=16, blocks=4):
    t, hkv, d = k.shape
    k_cache = torch.full((blocks, hkv, block_size, d), float("nan")).to(FP8)
    v_cache = k_cache.clone()
    q = torch.zeros(t, hkv, d)
    positions = torch.zeros(t, dtype=torch.int32)  # position 0: RoPE is the identity
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(t))[:t]
    reference.rope_and_cache(
        q, k / scale_k, v / scale_v, positions, cos_sin_cache(d, 8), k_cache, v_cache, slots.int()
    )
    return k_cache, v_cache, slots.long()


def test_fp8_write_round_trips_within_e4m3_spacing_and_saturates():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(37, 2, 64, generator=g) * 3
    v = torch.randn(37, 2, 64, generator=g) * 0.01
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-9])  # beyond the range; zero; underflow
    scale_k, scale_v = 0.05, 1e-4
    k_cache, v_cache, slots = write(k, v, scale_k, scale_v)
    for cache, x, scale in ((k_cache, k, scale_k), (v_cache, v, scale_v)):
        stored = cache.float()[slots // 16, :, slots % 16]  # [T, Hkv, D] in stored units
        assert not stored.isnan().any()
        target = (x / scale).clamp(-448, 448)
        assert (stored - target).abs().le(e4m3_spacing(target) / 2 + 1e-12).all()
    assert k_cache.float()[slots[0] // 16, 0, slots[0] % 16, :2].tolist() == [448.0, -448.0]


@pytest.mark.parametrize("op", ["paged_attention", "flash_prefill"])
def test_attention_over_fp8_cache_equals_attention_over_dequantized_cache(op):
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, lens = 6, 2, 64, [20, 5]
    total = sum(lens)
    k = torch.randn(total, hkv, d, generator=g) * 2
    v = torch.randn(total, hkv, d, generator=g)
    scale_k, scale_v = k.abs().max().item() / 224, v.abs().max().item() / 224
    block_size, blocks = 8, 8
    k_cache = torch.zeros(blocks, hkv, block_size, d).to(FP8)
    v_cache = k_cache.clone()
    tables = torch.tensor([[3, 0, 5], [6, 1, 2]], dtype=torch.int32)
    slots = torch.cat([tables[b].repeat_interleave(block_size)[:n] * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(lens)])  # fmt: skip
    q0 = torch.zeros(total, hkv, d)
    reference.rope_and_cache(
        q0, k / scale_k, v / scale_v, torch.zeros(total, dtype=torch.int32),
        cos_sin_cache(d, 4), k_cache, v_cache, slots.int(),
    )  # fmt: skip
    k_deq, v_deq = k_cache.float() * scale_k, v_cache.float() * scale_v
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if op == "paged_attention":
        q = torch.randn(2, hq, d, generator=g)
        run = lambda kc, vc, s: reference.paged_attention(q, kc, vc, tables, seq_lens, scale=s)  # noqa: E731
    else:
        q = torch.randn(total, hq, d, generator=g)
        cu = torch.tensor([0, lens[0], total], dtype=torch.int32)
        run = lambda kc, vc, s: reference.flash_prefill(q, kc, vc, cu, tables, seq_lens, scale=s)  # noqa: E731
    got = run(k_cache, v_cache, d**-0.5 * scale_k) * scale_v
    want = run(k_deq, v_deq, d**-0.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and stays near attention over the unquantized keys and values (E4M3: 3 mantissa bits)
    k_exact, v_exact = torch.zeros_like(k_deq), torch.zeros_like(v_deq)
    k_exact[slots // block_size, :, slots % block_size] = k
    v_exact[slots // block_size, :, slots % block_size] = v
    exact = run(k_exact, v_exact, d**-0.5)
    assert (got - exact).norm() / exact.norm() < 0.05


def test_model_fp8_cache_sizes_and_scales():
    model, _ = load_model("synthetic:tiny", kv_cache_dtype="fp8")
    cache = model.allocate_kv_cache(4, 16)
    assert cache.data.dtype == FP8 and cache.is_fp8 and len(cache.scales) == 2
    assert all(k > 0 and v > 0 and math.isfinite(k + v) for k, v in cache.scales)
    dense = allocate_kv_cache(model.config, 4, 16, dtype=torch.float32)
    assert cache.data.nbytes * 4 == dense.data.nbytes
    with pytest.raises(ValueError, match="fp8 KV cache needs"):
        allocate_kv_cache(model.config, 4, 16, dtype=FP8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load_model("synthetic:tiny", kv_cache_dtype="int8")


def test_engine_runs_with_an_fp8_cache():
    llm = LLM("synthetic:tiny", kv_cache_dtype="fp8", device="cpu", num_blocks=16)
    assert llm.engine.kv_cache.data.dtype == FP8
    out = llm.generate(
        ["a b c d e f"] * 3, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    assert [len(g.token_ids) for g in out] == [6, 6, 6]
    assert out[0].token_ids == out[1].token_ids  # same prompt, greedy: same answer


def _fp8_attention_args(q_dtype=torch.bfloat16):
    q = torch.randn(2, 4, 64).to(q_dtype)
    k_cache = torch.randn(4, 2, 16, 64).to(FP8)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return q, k_cache, k_cache.clone(), tables, torch.tensor([20, 7], dtype=torch.int32)


def test_ops_with_an_fp8_cache_equal_the_reference_and_take_the_scales():
    # The op layer passes k_scale / v_scale through unchanged. On CPU tensors it runs the CPU
    # backend's attention, whose fp32 sums may round a bf16 output one unit apart from the
    # reference's (a few draws in a hundred); a scale lost or swapped is off by far more.
    q, k_cache, v_cache, tables, lens = _fp8_attention_args()
    scales = dict(k_scale=0.3, v_scale=0.02)
    got = pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, **scales)
    want = reference.paged_attention(q, k_cache, v_cache, tables, lens, **scales)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
    k_deq, v_deq = k_cache.double() * 0.3, v_cache.double() * 0.02
    deq = reference.paged_attention(q.double(), k_deq, v_deq, tables, lens)
    assert float((got.double() - deq).norm() / deq.norm()) < 1e-2
    k = torch.randn(3, 2, 64).bfloat16()
    args = [torch.zeros(3, 4, 64).bfloat16(), k, k.clone(), torch.zeros(3, dtype=torch.int32)]
    args += [cos_sin_cache(64, 4), k_cache, v_cache, torch.arange(3, dtype=torch.int32)]
    pagedkern.rope_and_cache(*args, k_scale=0.5, v_scale=0.25)
    stored = v_cache[0, :, :3].transpose(0, 1).float()  # slots 0..2 of page 0
    assert torch.equal(stored, (k.float() * 4).clamp(-448, 448).to(FP8).float())


@pytest.mark.parametrize(
    "change, error, words",
    [
        ("e5m2", TypeError, "k_cache .*float8_e5m2.*must have the dtype of q"),
        ("mixed", TypeError, "v_cache .*bfloat16.* must have the dtype of k_cache"),
        ("scale_on_16bit", ValueError, "k_scale applies to an fp8"),
        ("zero_scale", ValueError, "v_scale must be a finite positive number"),
        ("nan_scale", ValueError, "k_scale must be a finite positive number"),
    ],
)
def test_fp8_cache_arguments_are_checked_by_name(change, error, words):
    q, k_cache, v_cache, tables, lens = _fp8_attention_args()
    scales = {}
    if change == "e5m2":
        k_cache = v_cache = k_cache.float().to(torch.float8_e5m2)
    elif change == "mixed":
        v_cache = v_cache.float().bfloat16()
    elif change == "scale_on_16bit":
        k_cache, v_cache, scales = k_cache.bfloat16(), v_cache.bfloat16(), {"k_scale": 2.0}
    elif change == "zero_scale":
        scales = {"v_scale": 0.0}
    else:
        scales = {"k_scale": math.nan}
    with pytest.raises(error, match=words):
        pagedkern.paged_attention(q, k_cache, v_cache, tables, lens, **scales)
