"""The reference attention options (sliding window, logit soft-cap, attention sinks) against a
float64 textbook softmax, over odd shapes: window 1, a window inside a block, a window longer
than the sequence, soft-caps on large logits, sinks (with the options together), through the
NaN-poisoned paged caches of test_reference_attention. The window's convention is checked
against transformers' own mask function."""

from __future__ import annotations

import math

import pytest
import torch
from test_reference_attention import D, _paged_cache, _randn

from pagedkern.reference import flash_prefill, paged_attention


def _attention64(q, k, v, scale, first_pos, window=None, cap=None, sinks=None):
    """q [Tq, Hq, D] at positions first_pos.., k/v [L, Hkv, D] -> (out, lse) float64 with the
    options written out: key j visible to the query at p when j <= p and p - j < window."""
    tq, hq, _ = q.shape
    length, hkv, _ = k.shape
    out = torch.zeros(tq, hq, D, dtype=torch.float64)
    lse = torch.zeros(tq, hq, dtype=torch.float64)
    pos = first_pos + torch.arange(tq)[:, None]
    key = torch.arange(length)[None, :]
    visible = key <= pos
    if window is not None:
        visible &= pos - key < window
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = (q[:, h].double() @ k[:, kv].double().T) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~visible, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, torch.full((tq, 1), float(sinks[h]))], -1)
        m = scores.max(-1, keepdim=True).values
        weights = torch.exp(scores - m)
        denom = weights.sum(-1, keepdim=True)
        if sinks is not None:
            weights = weights[:, :-1]
        out[:, h] = (weights / denom) @ v[:, kv].double()
        lse[:, h] = (m + denom.log())[:, 0]
    return out, lse


# (window, soft_cap, sinks): each alone, and all together
OPTIONS = [
    (1, None, False),
    (5, None, False),  # inside a 16-slot block
    (16, None, False),
    (33, None, False),
    (1000, None, False),  # longer than every sequence: plain causal attention
    (None, 2.0, False),  # caps scores of ~+-8 hard
    (None, None, True),
    (7, 3.0, True),
]
IDS = [f"window={w}-cap={c}-sinks={s}" for w, c, s in OPTIONS]


def _sinks(hq, g):
    return (torch.randn(hq, generator=g) * 2).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window, cap, with_sinks", OPTIONS, ids=IDS)
def test_paged_attention_options_match_dense(dtype, hq, hkv, window, cap, with_sinks):
    g = torch.Generator().manual_seed(hq * 10 + hkv + (window or 0))
    seq_lens = [1, 5, 15, 0, 16, 17, 40]
    keys, values, k_cache, v_cache, tables = _paged_cache(seq_lens, hkv, 16, dtype, g)
    q = _randn((len(seq_lens), hq, D), dtype, g) * 3  # larger logits: the cap bites
    sinks = _sinks(hq, g) if with_sinks else None
    out, lse = paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
        return_lse=True, sliding_window=window, soft_cap=cap, sinks=sinks,
    )  # fmt: skip
    assert not out.isnan().any()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8}[dtype]
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
            continue
        want, want_lse = _attention64(
            q[b : b + 1], keys[b], values[b], D**-0.5, n - 1, window, cap, sinks
        )
        torch.testing.assert_close(out[b : b + 1].double(), want, rtol=rtol * 1.01, atol=1e-5)
        torch.testing.assert_close(lse[b : b + 1].double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window, cap, with_sinks", OPTIONS, ids=IDS)
def test_flash_prefill_options_match_dense(hq, hkv, window, cap, with_sinks):
    g = torch.Generator().manual_seed(hq * 10 + hkv + 1 + (window or 0))
    pairs = [(p, c) for p in [0, 15, 16, 40] for c in [1, 7, 33]]
    seq_lens = [p + c for p, c in pairs]
    keys, values, k_cache, v_cache, tables = _paged_cache(seq_lens, hkv, 16, torch.float32, g)
    cu = torch.tensor([0] + [c for _, c in pairs]).cumsum(0).int()
    q = _randn((int(cu[-1]), hq, D), torch.float32, g) * 3
    sinks = _sinks(hq, g) if with_sinks else None
    out, lse = flash_prefill(
        q, k_cache, v_cache, cu, tables, torch.tensor(seq_lens, dtype=torch.int32),
        return_lse=True, sliding_window=window, soft_cap=cap, sinks=sinks,
    )  # fmt: skip
    assert not out.isnan().any()
    for b, (prefix, _) in enumerate(pairs):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want, want_lse = _attention64(
            q[rows], keys[b], values[b], D**-0.5, prefix, window, cap, sinks
        )
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[rows].double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, cap, with_sinks", OPTIONS, ids=IDS)
def test_one_token_chunks_with_options_equal_decode(window, cap, with_sinks):
    # The engine's batch invariance: a one-token prefill chunk is its decode step, bit for bit,
    # with the options too.
    g = torch.Generator().manual_seed(5)
    seq_lens = torch.tensor([1, 6, 16, 17, 50], dtype=torch.int32)
    _, _, k_cache, v_cache, tables = _paged_cache(seq_lens.tolist(), 2, 16, torch.float32, g)
    q = _randn((5, 8, D), torch.float32, g) * 3
    options = dict(sliding_window=window, soft_cap=cap, sinks=_sinks(8, g) if with_sinks else None)
    cu = torch.arange(6, dtype=torch.int32)
    prefill = flash_prefill(q, k_cache, v_cache, cu, tables, seq_lens, **options)
    decode = paged_attention(q, k_cache, v_cache, tables, seq_lens, **options)
    assert torch.equal(prefill, decode)


def test_sliding_window_is_transformers_convention():
    masking = pytest.importorskip("transformers.masking_utils")
    window, n = 4, 10
    mask_fn = masking.sliding_window_causal_mask_function(window)
    t = torch.tensor
    hf = torch.tensor([[bool(mask_fn(t(0), t(0), t(i), t(j))) for j in range(n)] for i in range(n)])
    # ours: one value per key, its output row the value of the keys the query sees summed
    g = torch.Generator().manual_seed(0)
    _, _, k_cache, v_cache, tables = _paged_cache([n], 1, 4, torch.float32, g)
    k_cache.nan_to_num_(0.0).zero_()  # equal scores: uniform weights over the visible keys
    v_cache.nan_to_num_(0.0).zero_()
    for j in range(n):
        v_cache[tables[0, j // 4], 0, j % 4, 0] = float(1 << j)
    q = torch.zeros(n, 1, D)
    out = flash_prefill(
        q, k_cache, v_cache, torch.tensor([0, n]).int(), tables, torch.tensor([n]).int(),
        sliding_window=window,
    )  # fmt: skip
    counts = hf.sum(1)
    seen = torch.round(out[:, 0, 0].double() * counts).long()
    ours = torch.tensor([[bool(int(s) >> j & 1) for j in range(n)] for s in seen.tolist()])
    assert torch.equal(ours, hf)


def test_a_window_reads_only_its_blocks(monkeypatch):
    # Keys older than the window are not gathered at all: a windowed layer's cost follows the
    # window, not the sequence (a 16-key window over 300 keys in 16-slot blocks: 2 blocks).
    import pagedkern.reference.attention as attention

    spans = []
    gather = attention.gather_pages
    monkeypatch.setattr(
        attention, "gather_pages", lambda c, p, d: spans.append(p.shape[1]) or gather(c, p, d)
    )
    g = torch.Generator().manual_seed(9)
    seq_lens = [300, 17]
    keys, values, k_cache, v_cache, tables = _paged_cache(seq_lens, 2, 16, torch.float32, g)
    q = _randn((2, 4, D), torch.float32, g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention(q, k_cache, v_cache, tables, lens, sliding_window=16)
    assert max(spans) == 2
    for b, n in enumerate(seq_lens):
        want, _ = _attention64(q[b : b + 1], keys[b], values[b], D**-0.5, n - 1, 16)
        torch.testing.assert_close(out[b : b + 1].double(), want, rtol=1e-5, atol=1e-5)
    spans.clear()
    chunk = _randn((5, 4, D), torch.float32, g)  # the last 5 queries of the long sequence
    out = flash_prefill(
        chunk, k_cache, v_cache, torch.tensor([0, 5]).int(), tables[:1], lens[:1],
        sliding_window=16,
    )  # fmt: skip
    assert max(spans) == 2  # keys 280..299: blocks 17 and 18
    want, _ = _attention64(chunk, keys[0], values[0], D**-0.5, 295, 16)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
