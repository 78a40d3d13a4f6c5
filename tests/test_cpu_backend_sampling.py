"""The CPU backend's sampling (ops/cpu/sampling.py over csrc/cpu/sampling.cpp) against
reference.sample: the same philox draw, every id one the reference's distribution can give,
the reference's id in all but boundary rows, the edge rows (NaN, +-inf, ties, overflow) exactly,
the draw's frequencies, and ids independent of the batch and the thread count."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkern import ops, reference
from pagedkern.ops import variants
from pagedkern.ops.cpu import quant_gemv
from pagedkern.ops.cpu import sampling as cpu_sampling
from pagedkern.reference.sampling import sampling_distribution

pytestmark = pytest.mark.skipif(not quant_gemv.available(), reason="pagedkern._cpu is not built")

INF = float("inf")


def _params(rows: int, g: torch.Generator) -> dict:
    """Per-row parameters mixing greedy, plain, top-k (small and past the heap / sparse
    bounds), top-p and min-p rows."""
    pick = torch.rand(rows, 4, generator=g)
    temperature = torch.where(pick[:, 0] < 0.2, 0.0, 0.3 + 1.2 * torch.rand(rows, generator=g))
    top_k = torch.randint(1, 60, (rows,), generator=g)
    top_k = torch.where(pick[:, 1] < 0.5, 0, top_k)
    top_k[pick[:, 1] > 0.9] = 1500  # past the min-heap
    top_p = torch.where(pick[:, 2] < 0.5, 1.0, 0.2 + 0.79 * torch.rand(rows, generator=g))
    min_p = torch.where(pick[:, 3] < 0.7, 0.0, 0.2 * torch.rand(rows, generator=g))
    return {
        "temperature": temperature.float(),
        "top_p": top_p.float(),
        "top_k": top_k.int(),
        "seeds": torch.randint(-(2**62), 2**62, (rows,), generator=g),
        "offsets": torch.randint(0, 2**40, (rows,), generator=g),
        "min_p": min_p.float(),
    }


def _cpp(logits, p, **kw) -> torch.Tensor:
    out = torch.full((logits.shape[0],), -7, dtype=torch.int32)  # poisoned
    cpu_sampling.sample(
        logits, p["temperature"], p["top_p"], p["top_k"], p["seeds"], p["offsets"], out,
        min_p=p["min_p"], **kw,
    )  # fmt: skip
    return out


def _reference(logits, p, **kw) -> torch.Tensor:
    return reference.sample(
        logits, p["temperature"], p["top_p"], p["top_k"], p["seeds"], p["offsets"],
        min_p=p["min_p"], **kw,
    )  # fmt: skip


def test_the_draw_is_the_references_philox():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (200,), generator=g)
    offsets = torch.randint(0, 2**62, (200,), generator=g)
    cpu = quant_gemv.cpu_module()
    got = [cpu.philox_uniform(int(s), int(o)) for s, o in zip(seeds, offsets, strict=True)]
    assert got == reference.sampling.uniform(seeds, offsets).tolist()


@pytest.mark.parametrize("vocab", [1, 7, 33, 1000, 4099, 20011])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_ids_follow_the_reference(vocab, rows):
    g = torch.Generator().manual_seed(vocab * 100 + rows)
    logits = torch.randn(rows, vocab, generator=g) * (0.3 + 4 * torch.rand(rows, 1, generator=g))
    p = _params(rows, g)
    got = _cpp(logits, p)
    want = _reference(logits, p)
    assert ((got >= 0) & (got < vocab)).all()
    dist = sampling_distribution(logits, p["temperature"], p["top_p"], p["top_k"], p["min_p"])
    assert (dist[torch.arange(rows), got.long()] > 0).all()  # never outside the kept set
    greedy = p["temperature"] <= 0
    assert torch.equal(got[greedy], want[greedy])
    # a sampled id differs only where rounding moves a boundary: ~1e-6 of rows
    assert (got != want).sum() <= max(1, rows // 100)


def test_flat_rows_take_the_top_p_histogram_and_agree():
    """Flat rows: the few largest probabilities do not reach top_p, so the cut is found by the
    mass histogram; large top-k rows take the nth_element and dense paths."""
    g = torch.Generator().manual_seed(1)
    rows, vocab = 24, 30000
    logits = torch.randn(rows, vocab, generator=g) * 0.5
    p = _params(rows, g)
    p["temperature"] = torch.full((rows,), 1.0)
    p["top_p"] = torch.linspace(0.05, 0.99, rows)
    p["top_k"] = torch.tensor([0, 5000, 2000, 0] * 6, dtype=torch.int32)
    p["min_p"] = torch.zeros(rows)
    got, want = _cpp(logits, p), _reference(logits, p)
    assert (got != want).sum() <= 1


def test_edge_rows():
    vocab = 9
    rows = [
        [1.0, 3.0, 3.0, 0.0, -1.0, 2.0, 3.0, 0.5, 0.0],  # greedy ties: the lowest id
        [math.nan] * vocab,  # nothing finite: id 0
        [-INF] * vocab,
        [0.0, INF, 1.0, INF, math.nan, -INF, 2.0, INF, 0.0],  # uniform over the +inf ids
        [1e30, 3e38, -1e30, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # x / T overflows: greedy
        [0.0, 5.0, 5.0, 5.0, 1.0, 0.0, 5.0, 0.0, 0.0],  # top-k 2 keeps the 4 tied
        [0.0, 5.0, 5.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # top-p 0.1 keeps the tied pair
        [0.0, 5.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # min-p above 1: greedy
        [math.nan, -INF, math.nan, 2.0, -INF, 2.0, 1.0, math.nan, 0.0],  # NaN as -inf
    ]
    n = len(rows)
    logits = torch.tensor(rows)
    p = {
        "temperature": torch.tensor([0.0, 1.0, 1.0, 1.0, 1e-38, 1.0, 1.0, 1.0, 0.8]),
        "top_p": torch.tensor([1.0] * 6 + [0.1, 1.0, 0.5]),
        "top_k": torch.tensor([0] * 5 + [2, 0, 0, 0], dtype=torch.int32),
        "seeds": torch.arange(n, dtype=torch.int64),
        "offsets": torch.zeros(n, dtype=torch.int64),
        "min_p": torch.tensor([0.0] * 7 + [1.5, 0.0]),
    }
    for offset in range(40):  # many draws of each row: every one in the allowed set
        p["offsets"] = torch.full((n,), offset, dtype=torch.int64)
        got = _cpp(logits, p).tolist()
        assert got[:3] == [1, 0, 0]
        assert got[3] in (1, 3, 7)
        assert got[4] == 1 and got[7] == 1
        assert got[5] in (1, 2, 3, 6) and got[6] in (1, 2)
        assert got[8] in (3, 5, 6, 8)
        assert got == _reference(logits, p).tolist()


@pytest.mark.parametrize("quad", [0, 1, 2, 3])
def test_a_nan_never_hides_the_largest_logit(quad):
    """NaN beside the largest logit in each 4-lane position of a 16-token block (a vector max
    that lets NaN win drops its partner lane's values: a wrong max, probabilities above 1, and
    top-p's scan never ended)."""
    rows, vocab = 8, 64
    g = torch.Generator().manual_seed(quad)
    logits = torch.randn(rows, vocab, generator=g)
    for r in range(rows):
        block = 16 * (r % 4)
        logits[r, block + 4 * quad + r % 4] = 50.0 + r  # the row's largest
        for other in range(4):  # NaN in every other quad of that block, same lane
            if other != quad:
                logits[r, block + 4 * other + r % 4] = math.nan
    p = _params(rows, g)
    p["temperature"][:4] = 0.0
    p["temperature"][4:] = 2.0
    p["top_p"][:] = 0.9
    p["top_k"][4:6] = 2
    p["min_p"][:] = 0.0
    got = _cpp(logits, p)
    assert torch.equal(got, _reference(logits, p))
    assert torch.equal(got[:4], logits[:4].nan_to_num(-INF).argmax(-1).int())


def test_frequencies_follow_the_distribution():
    """20000 draws of one row (offsets 0..N-1: the deterministic philox stream) against the
    reference distribution, within 5 standard deviations per token."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 2.5, -0.5, 1.5, 0.2, -3.0]])
    draws = 20000
    for temperature, top_p, top_k, min_p in [(1.0, 1.0, 0, 0.0), (0.7, 0.8, 0, 0.0),
                                             (1.3, 1.0, 4, 0.0), (1.0, 0.9, 6, 0.05)]:  # fmt: skip
        p = {
            "temperature": torch.full((draws,), temperature),
            "top_p": torch.full((draws,), top_p),
            "top_k": torch.full((draws,), top_k, dtype=torch.int32),
            "seeds": torch.full((draws,), 1234, dtype=torch.int64),
            "offsets": torch.arange(draws, dtype=torch.int64),
            "min_p": torch.full((draws,), min_p),
        }
        ids = _cpp(logits.expand(draws, -1).contiguous(), p)
        freq = torch.bincount(ids.long(), minlength=logits.shape[1]).double() / draws
        want = sampling_distribution(logits, temperature, top_p, top_k, min_p)[0]
        bound = 5 * torch.sqrt(want * (1 - want) / draws) + 1e-12
        assert ((freq - want).abs() <= bound).all(), (freq, want)
        assert (freq[want == 0] == 0).all()


def test_ids_do_not_depend_on_the_batch_or_threads():
    g = torch.Generator().manual_seed(2)
    rows, vocab = 29, 5003
    logits = torch.randn(rows, vocab, generator=g) * 3
    p = _params(rows, g)
    whole = _cpp(logits, p)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_cpp(logits, p), whole)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 11, rows - 1):
        one = {name: value[r : r + 1] for name, value in p.items()}
        assert _cpp(logits[r : r + 1], one).item() == whole[r].item()


def test_processing_logprobs_and_half_logits_match_the_reference():
    g = torch.Generator().manual_seed(3)
    rows, vocab = 5, 300
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(torch.bfloat16)
    p = _params(rows, g)
    p["temperature"][0] = 0.0
    processing = {
        "token_offsets": torch.tensor([0, 2, 2, 3, 5, 6], dtype=torch.int32),
        "token_ids": torch.tensor([4, 9, 7, 1, 2, 250], dtype=torch.int32),
        "token_counts": torch.tensor([2, -1, 0, 3, 1, -1], dtype=torch.int32),
        "token_bias": torch.tensor([0.5, -INF, 1.0, 0.0, -2.0, 3.0]),
        "presence_penalty": torch.full((rows,), 0.5),
        "frequency_penalty": torch.full((rows,), 0.25),
        "repetition_penalty": torch.full((rows,), 1.2),
    }
    outputs = {}
    for name, fn in (("cpp", _cpp), ("reference", _reference)):
        lp = torch.full((rows,), math.nan)
        top_ids = torch.full((rows, 4), -1, dtype=torch.int32)
        top_lp = torch.full((rows, 4), math.nan)
        ids = fn(logits, p, logprobs=lp, top_ids=top_ids, top_logprobs_out=top_lp, **processing)
        outputs[name] = (ids, lp, top_ids, top_lp)
    (ids, lp, top_ids, top_lp), (want_ids, want_lp, want_top_ids, want_top_lp) = (
        outputs["cpp"],
        outputs["reference"],
    )
    assert torch.equal(ids, want_ids) and torch.equal(top_ids, want_top_ids)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)  # (-inf where it is -inf)
    torch.testing.assert_close(top_lp, want_top_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [1, 5, 21, 1000, 49157])
def test_logprob_outputs_follow_the_reference(vocab):
    """The sampled id's log-probability and the top-N (ties to the lower id) over odd shapes,
    greedy and sampled rows, ties, a row holding +inf, a row with nothing finite and one whose
    scaled logits overflow."""
    g = torch.Generator().manual_seed(vocab)
    rows = 7
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[1] = logits[1].round()  # many ties
    logits[2, : min(3, vocab)] = INF
    logits[3] = -INF
    logits[4, ::2] = math.nan
    logits[5, 0] = 3e38
    p = _params(rows, g)
    p["temperature"][:] = torch.tensor([0.0, 0.7, 1.0, 1.0, 0.5, 1e-37, 1.3])
    n = min(20, vocab)
    outputs = []
    for fn in (_cpp, _reference):
        lp = torch.full((rows,), math.nan)
        top_ids = torch.full((rows, n), -1, dtype=torch.int32)
        top_lp = torch.full((rows, n), math.nan)
        ids = fn(logits, p, logprobs=lp, top_ids=top_ids, top_logprobs_out=top_lp)
        outputs.append((ids, lp, top_ids, top_lp))
    (ids, lp, top_ids, top_lp), (want_ids, want_lp, want_top_ids, want_top_lp) = outputs
    assert torch.equal(ids, want_ids) and torch.equal(top_ids, want_top_ids)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(top_lp, want_top_lp, atol=1e-5, rtol=1e-5)


def test_ops_sample_runs_the_kernel_and_the_variant_selects_the_reference(monkeypatch):
    logits = torch.randn(2, 50)
    calls = []
    kernel = quant_gemv.cpu_module().sample
    monkeypatch.setattr(cpu_sampling.quant_gemv, "cpu_module", lambda: _Spy(kernel, calls))
    ops.sample(logits, 0.8, 0.9, 5, 7, 0)
    assert len(calls) == 1
    monkeypatch.setenv(variants.ENV_NAME, "cpu_sample:reference")
    ids = ops.sample(logits, 0.8, 0.9, 5, 7, 0)
    assert len(calls) == 1  # the reference ran
    assert torch.equal(ids, reference.sample(logits, 0.8, 0.9, 5, 7, 0))


class _Spy:
    def __init__(self, kernel, calls):
        self._kernel, self._calls = kernel, calls

    def sample(self, **kwargs):
        self._calls.append(kwargs)
        return self._kernel(**kwargs)
