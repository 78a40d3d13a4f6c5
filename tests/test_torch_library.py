"""pagedkern's ops registered as torch custom ops (ops/torch_library.py): torch's opcheck passes
for every op over its dtypes (schema and mutations, fake implementation, autograd
registration, dynamic shapes through the fake), the registered call equals the direct one, and
a tiny Llama block written with them compiles with fullgraph=True to the eager result. On the
CPU they run the references; the same registrations dispatch to the kernels on CUDA tensors
(the GPU test files cover the kernels themselves)."""

from __future__ import annotations

import pytest
import torch

import pagedkern.ops as direct
from pagedkern.ops import torch_library
from pagedkern.reference import cos_sin_cache

ops = torch.ops.pagedkern
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, g, device="cpu"):
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _paged_kv(seq_lens, hkv, d, block_size, dtype, g, device="cpu"):
    """Caches [N, Hkv, bs, D] with each sequence's blocks in a shuffled order, and its table."""
    blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(blocks) + 2
    order = torch.randperm(total, generator=g).tolist()
    width = max(blocks)
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    k = 0
    for b, n in enumerate(blocks):
        table[b, :n] = torch.tensor(order[k : k + n], dtype=torch.int32)
        k += n
    shape = (total, hkv, block_size, d)
    return _randn(shape, dtype, g, device), _randn(shape, dtype, g, device), table.to(device)


def _check(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs or {})


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_activation(dtype, device="cpu"):
    g = _g(1)
    x, w = _randn((5, 48), dtype, g, device), _randn((48,), dtype, g, device)
    _check(ops.rms_norm.default, (x, w, 1e-5))
    assert torch.equal(ops.rms_norm(x, w, 1e-5), direct.rms_norm(x, w, 1e-5))
    residual = _randn((5, 48), dtype, g, device)
    _check(ops.fused_add_rms_norm.default, (x.clone(), residual.clone(), w, 1e-5))
    x1, r1, x2, r2 = x.clone(), residual.clone(), x.clone(), residual.clone()
    ops.fused_add_rms_norm(x1, r1, w, 1e-5)
    direct.fused_add_rms_norm(x2, r2, w, 1e-5)
    assert torch.equal(x1, x2) and torch.equal(r1, r2) and not torch.equal(x1, x)
    gate_up = _randn((7, 2 * 32), dtype, g, device)
    _check(ops.silu_and_mul.default, (gate_up,))
    assert torch.equal(ops.silu_and_mul(gate_up), direct.silu_and_mul(gate_up))
    _check(ops.gelu_tanh_and_mul.default, (gate_up,))
    assert torch.equal(ops.gelu_tanh_and_mul(gate_up), direct.gelu_tanh_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache(dtype, device="cpu"):
    g = _g(2)
    tokens, hq, hkv, d, bs, blocks = 6, 4, 2, 64, 4, 5
    q, k, v = (_randn((tokens, h, d), dtype, g, device) for h in (hq, hkv, hkv))
    positions = torch.tensor([0, 3, 1, 9, 4, 2], dtype=torch.int32, device=device)
    table = cos_sin_cache(d, 32).to(device)
    k_cache = _randn((blocks, hkv, bs, d), dtype, g, device)
    v_cache = _randn((blocks, hkv, bs, d), dtype, g, device)
    slots = torch.tensor([0, 5, -1, 17, 3, 8], dtype=torch.int32, device=device)
    args = (q, k, v, positions, table, k_cache, v_cache, slots)
    _check(ops.rope_and_cache.default, tuple(a.clone() for a in args))
    mine = [a.clone() for a in args]
    ops.rope_and_cache(*mine)
    theirs = [a.clone() for a in args]
    direct.rope_and_cache(*theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(mine[0], q) and not torch.equal(mine[5], k_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(dtype, device="cpu"):
    g = _g(3)
    hq, hkv, d, bs = 4, 2, 64, 16
    seq_lens = [5, 1, 41]
    k_cache, v_cache, table = _paged_kv(seq_lens, hkv, d, bs, dtype, g, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = _randn((3, hq, d), dtype, g, device)
    args = (q, k_cache, v_cache, table, lens)
    _check(ops.paged_attention.default, args)
    _check(ops.paged_attention_with_lse.default, args, {"scale": 0.3})
    assert torch.equal(ops.paged_attention(*args), direct.paged_attention(*args))
    out, lse = ops.paged_attention_with_lse(*args)
    want_out, want_lse = direct.paged_attention(*args, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    chunks = [3, 1, 4]  # the last query rows of each sequence
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32, device=device)
    qp = _randn((sum(chunks), hq, d), dtype, g, device)
    pargs = (qp, k_cache, v_cache, cu, table, lens)
    _check(ops.flash_prefill.default, pargs)
    _check(ops.flash_prefill_with_lse.default, pargs)
    assert torch.equal(ops.flash_prefill(*pargs), direct.flash_prefill(*pargs))
    out, lse = ops.flash_prefill_with_lse(*pargs)
    want_out, want_lse = direct.flash_prefill(*pargs, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling(dtype, device="cpu"):
    g = _g(4)
    rows, vocab = 5, 97
    logits = _randn((rows, vocab), dtype, g, device) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0], device=device)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.8], device=device)
    top_k = torch.tensor([0, 5, 0, 40, 3], dtype=torch.int32, device=device)
    seeds = torch.arange(rows, dtype=torch.int64, device=device) * 7919
    offsets = torch.arange(rows, dtype=torch.int64, device=device)
    args = (logits, temperature, top_p, top_k, seeds, offsets)
    _check(ops.sample.default, args)
    _check(ops.sample.default, args, {"min_p": torch.full((rows,), 0.05, device=device)})
    _check(ops.sample_with_logprobs.default, (*args, 3))
    ids = ops.sample(*args)
    assert torch.equal(ids, direct.sample(*args))
    ids2, logprobs, top_ids, top_logprobs = ops.sample_with_logprobs(*args, 3)
    assert torch.equal(ids2, ids)
    assert top_ids.shape == (rows, 3) and torch.all(top_logprobs[:, :-1] >= top_logprobs[:, 1:])
    greedy = temperature == 0
    assert torch.equal(ids[greedy], top_ids[greedy, 0])
    assert torch.equal(logprobs[greedy], top_logprobs[greedy, 0])


def test_rejection_sample():
    g = _g(5)
    batch, vocab = 3, 31
    drafts = [2, 0, 3]
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    target = torch.softmax(torch.randn((sum(drafts) + batch, vocab), generator=g), -1)
    draft_probs = torch.softmax(torch.randn((sum(drafts), vocab), generator=g), -1)
    draft_ids = torch.randint(0, vocab, (sum(drafts),), generator=g, dtype=torch.int32)
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    offsets = torch.zeros(batch, dtype=torch.int64)
    args = (target, draft_ids, draft_probs, cu, seeds, offsets, 4)
    _check(ops.rejection_sample.default, args)
    _check(ops.rejection_sample.default, (target, draft_ids, None, cu, seeds, offsets, 3))
    ids, counts = ops.rejection_sample(*args)
    want_ids, want_counts = direct.rejection_sample(*args[:-1])
    assert ids.shape == (batch, 5) and torch.equal(counts, want_counts)
    assert torch.equal(ids[:, : want_ids.shape[1]], want_ids)
    assert torch.all(ids[:, want_ids.shape[1] :] == -1)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quant_linear(fmt):
    from pagedkern.model.quantized_linear import quantize

    g = _g(6)
    weight = torch.randn((24, 64), generator=g)
    q = quantize(weight, fmt)
    x = torch.randn((3, 64), generator=g)
    args = (x, q.qweight, q.scales, q.mins, q.format, 24, q.group_size)
    _check(ops.quant_linear.default, args)
    assert torch.equal(ops.quant_linear(*args), direct.quant_linear(x, q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe(dtype):
    g = _g(7)
    hidden, router = _randn((5, 32), dtype, g, "cpu"), _randn((5, 6), torch.float32, g, "cpu")
    gate_up, down = _randn((6, 2 * 16, 32), dtype, g, "cpu"), _randn((6, 32, 16), dtype, g, "cpu")
    for renormalize, activation in [(True, "silu"), (False, "gelu_tanh")]:
        args = (hidden, router, gate_up, down, 2, renormalize, activation)
        _check(ops.fused_moe.default, args)
        want = direct.fused_moe(*args[:5], renormalize=renormalize, activation=activation)
        assert torch.equal(ops.fused_moe(*args), want)


class TinyBlock(torch.nn.Module):
    """One Llama decoder layer over a paged cache, written with the registered ops: norm, QKV,
    RoPE + cache write, prefill attention, O, fused add+norm, gate/up, SiLU x mul, down."""

    def __init__(self, hidden=32, hq=4, hkv=2, inter=48, g=None):
        super().__init__()
        d = hidden // hq
        self.hq, self.hkv, self.d = hq, hkv, d

        def p(*shape):
            return torch.nn.Parameter(torch.randn(shape, generator=g) * shape[-1] ** -0.5)

        self.norm1 = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g))
        self.norm2 = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g))
        self.qkv, self.o = p((hq + 2 * hkv) * d, hidden), p(hidden, hq * d)
        self.gate_up, self.down = p(2 * inter, hidden), p(hidden, inter)
        self.register_buffer("cos_sin", cos_sin_cache(d, 64), persistent=False)

    def forward(self, x, positions, slots, k_cache, v_cache, cu, table, lens):
        t = x.shape[0]
        h = ops.rms_norm(x, self.norm1, 1e-6)
        qkv = h @ self.qkv.T
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = q.reshape(t, self.hq, self.d).contiguous()
        k = k.reshape(t, self.hkv, self.d).contiguous()
        v = v.reshape(t, self.hkv, self.d).contiguous()
        ops.rope_and_cache(q, k, v, positions, self.cos_sin, k_cache, v_cache, slots)
        attn = ops.flash_prefill(q, k_cache, v_cache, cu, table, lens)
        out = attn.reshape(t, -1) @ self.o.T
        residual = x.clone()
        ops.fused_add_rms_norm(out, residual, self.norm2, 1e-6)
        mlp = ops.silu_and_mul(out @ self.gate_up.T) @ self.down.T
        return mlp + residual


def test_a_llama_block_compiles_fullgraph_to_the_eager_result(
    device="cpu", dtype=torch.float32, backend="aot_eager"
):
    torch._dynamo.reset()
    g = _g(7)
    block = TinyBlock(hidden=256, hq=4, hkv=2, inter=96, g=g).to(device=device, dtype=dtype)
    block.cos_sin = block.cos_sin.float()  # the RoPE table stays float32 whatever the model's
    lens = [5, 3]
    t = sum(lens)
    x = torch.randn((t, 256), generator=g).to(device=device, dtype=dtype)
    i32 = {"dtype": torch.int32, "device": device}
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], **i32)
    table = torch.tensor([[0], [1]], **i32)
    slots = torch.tensor([0, 1, 2, 3, 4, 16, 17, 18], **i32)
    cu = torch.tensor([0, 5, 8], **i32)
    seq_lens = torch.tensor(lens, **i32)

    def cache():
        return tuple(torch.zeros((2, 2, 16, 64), device=device, dtype=dtype) for _ in range(2))

    eager_k, eager_v = cache()
    with torch.no_grad():
        want = block(x, positions, slots, eager_k, eager_v, cu, table, seq_lens)
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        got_k, got_v = cache()
        got = compiled(x, positions, slots, got_k, got_v, cu, table, seq_lens)
    assert torch.equal(got, want)
    assert torch.equal(got_k, eager_k) and torch.equal(got_v, eager_v)
    assert eager_k.abs().sum() > 0, "the cache was written"


def test_every_public_op_is_registered():
    public = set(direct.__all__) - {
        "KernelSupport", "KernelUnsupportedError", "get_backend", "set_backend", "use_backend"
    }  # fmt: skip
    registered = {getattr(ops, name).default for name in public}
    assert registered <= {getattr(ops, op._name).default for op in torch_library.OPS}
