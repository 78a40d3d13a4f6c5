"""Logits processing (penalties, bias, masks, min-p, logprobs) in the reference `sample` against
an independent float64 formulation written per token in plain Python, and the engine's host-side
state that feeds it (sparse entries built incrementally).

`_expected` restates pagedkern.reference.logits_processing's docstring token by token in float64;
every comparison is to it, on fresh random inputs with fixed seeds.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedkern import ops
from pagedkern.engine.logits_processing import LogitsState, allowed_bitmask, batch_processing
from pagedkern.engine.sampling_params import SamplingParams
from pagedkern.reference import sample
from pagedkern.reference.logits_processing import process_logits


def _expected(logits_row, entries, presence, frequency, repetition, allowed=None):
    """Processed logits of one row in float64, one token at a time."""
    x = [(-math.inf if math.isnan(v) else float(v)) for v in logits_row.tolist()]
    for token, count, bias in entries:
        v = x[token]
        if count >= 0:
            v = v / repetition if v > 0 else v * repetition
            v -= frequency * count + (presence if count > 0 else 0.0)
        v += bias
        x[token] = -math.inf if math.isnan(v) else v
    if allowed is not None:
        x = [v if t in allowed else -math.inf for t, v in enumerate(x)]
    return x


def _log_softmax(values, temperature):
    t = temperature if temperature > 0 else 1.0
    s = [v / t for v in values]
    m = max(s)
    if m == -math.inf:
        return [-math.inf] * len(s)
    z = sum(math.exp(v - m) for v in s if v > -math.inf)
    return [v - m - math.log(z) if v > -math.inf else -math.inf for v in s]


def _random_case(rows, vocab, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, 1] = float("nan")
    offsets, ids, counts, bias, per_row = [0], [], [], [], []
    for _ in range(rows):
        tokens = rng.sample(range(vocab), rng.randrange(0, min(vocab, 12)))
        row = []
        for t in tokens:
            count = rng.choice([-1, 0, 1, 2, 5])
            b = (
                rng.choice([0.0, 0.0, 2.5, -7.0, -math.inf])
                if count >= 0
                else rng.uniform(-100, 100)
            )
            row.append((t, count, b))
        per_row.append(row)
        ids += [t for t, _, _ in row]
        counts += [c for _, c, _ in row]
        bias += [b for _, _, b in row]
        offsets.append(len(ids))
    pen = lambda lo, hi: torch.tensor([rng.uniform(lo, hi) for _ in range(rows)])  # noqa: E731
    processing = dict(
        token_offsets=torch.tensor(offsets, dtype=torch.int32),
        token_ids=torch.tensor(ids, dtype=torch.int32),
        token_counts=torch.tensor(counts, dtype=torch.int32),
        token_bias=torch.tensor(bias, dtype=torch.float32),
        presence_penalty=pen(-2, 2),
        frequency_penalty=pen(-2, 2),
        repetition_penalty=pen(0.5, 2),
    )
    return logits, per_row, processing


@pytest.mark.parametrize("rows, vocab, seed", [(5, 37, 0), (9, 200, 1), (3, 1000, 2)])
def test_processed_logits_equal_the_float64_formulation(rows, vocab, seed):
    logits, per_row, processing = _random_case(rows, vocab, seed)
    allowed = [set(random.Random(seed + r).sample(range(vocab), vocab // 3)) for r in range(rows)]
    masked_rows = [r for r in range(rows) if r % 2 == 0]
    bitmask = torch.stack([allowed_bitmask(sorted(allowed[r]), vocab) for r in masked_rows])
    bitmask_rows = torch.tensor(
        [masked_rows.index(r) if r in masked_rows else -1 for r in range(rows)], dtype=torch.int32
    )
    x = process_logits(logits, bitmask=bitmask, bitmask_rows=bitmask_rows, **processing)
    for r in range(rows):
        want = _expected(
            logits[r],
            per_row[r],
            float(processing["presence_penalty"][r]),
            float(processing["frequency_penalty"][r]),
            float(processing["repetition_penalty"][r]),
            allowed[r] if r in masked_rows else None,
        )
        torch.testing.assert_close(
            x[r].double(),
            torch.tensor(want, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-5,
            equal_nan=False,
        )
        assert not x[r].isnan().any()
        # greedy picks the float64 argmax (ties to the lowest id)
        ids = sample(
            logits[r : r + 1],
            0.0,
            1.0,
            0,
            0,
            **_row(processing, r, rows),
            bitmask=bitmask,
            bitmask_rows=bitmask_rows[r : r + 1],
        )
        best = max(range(vocab), key=lambda t: (want[t], -t))
        if want[best] > -math.inf:
            assert int(ids[0]) == best


def _row(processing, r, rows):
    """The processing inputs of row r alone."""
    lo, hi = int(processing["token_offsets"][r]), int(processing["token_offsets"][r + 1])
    out = {k: processing[k][lo:hi] for k in ("token_ids", "token_counts", "token_bias")}
    out["token_offsets"] = torch.tensor([0, hi - lo], dtype=torch.int32)
    for k in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        out[k] = processing[k][r : r + 1]
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_are_the_float64_log_softmax_of_the_processed_logits(temperature):
    rows, vocab, n = 6, 300, 7
    logits, per_row, processing = _random_case(rows, vocab, 3)
    lp = torch.full((rows,), float("nan"))
    top_ids = torch.full((rows, n), -7, dtype=torch.int32)
    top_lp = torch.full((rows, n), float("nan"))
    ids = sample(
        logits,
        temperature,
        0.5,
        20,
        torch.arange(rows),
        logprobs=lp,
        top_ids=top_ids,
        top_logprobs_out=top_lp,
        min_p=torch.full((rows,), 0.1),
        **processing,
    )
    for r in range(rows):
        x = _expected(
            logits[r],
            per_row[r],
            *(
                float(processing[k][r])
                for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
            ),
        )
        want = _log_softmax(x, temperature)
        assert lp[r] <= 0 and abs(float(lp[r]) - want[int(ids[r])]) < 1e-4
        order = sorted(range(vocab), key=lambda t: (-want[t], t))[:n]
        assert top_ids[r].tolist() == order, "top-N: the N most likely, in descending order"
        assert (top_lp[r][1:] <= top_lp[r][:-1]).all()
        torch.testing.assert_close(
            top_lp[r].double(),
            torch.tensor([want[t] for t in order], dtype=torch.float64),
            rtol=0,
            atol=1e-4,
        )
        if temperature == 0:
            assert int(top_ids[r, 0]) == int(ids[r]) and float(top_lp[r, 0]) == float(lp[r])


def test_min_p_keeps_exactly_the_tokens_above_min_p_times_the_top():
    vocab, draws, min_p, temperature = 40, 3000, 0.2, 0.8
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1, vocab, generator=g)
    probs = torch.softmax(row.double()[0] / temperature, -1)
    kept = probs >= min_p * probs.max()
    assert ((probs - min_p * probs.max()).abs() > 1e-6).all(), "input too close to the cut"
    ids = sample(
        row.expand(draws, vocab),
        temperature,
        1.0,
        0,
        torch.arange(draws),
        min_p=torch.full((draws,), min_p),
    ).long()
    assert kept[ids].all(), "drew a token below min_p x the top probability"
    want = probs * kept / (probs * kept).sum()
    freq = torch.bincount(ids, minlength=vocab).double() / draws
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all()
    assert freq[kept].gt(0).sum() >= kept.sum() - 1


def test_op_validates_the_processing_arguments():
    logits = torch.zeros(2, 10)
    base = (logits, 1.0, 1.0, 0, 0)
    with pytest.raises(ValueError, match="token_offsets"):
        ops.sample(*base, token_ids=torch.zeros(1, dtype=torch.int32))
    good = dict(
        token_offsets=torch.tensor([0, 1, 1], dtype=torch.int32),
        token_ids=torch.zeros(1, dtype=torch.int32),
        token_counts=torch.zeros(1, dtype=torch.int32),
        token_bias=torch.zeros(1),
        presence_penalty=torch.zeros(2),
        frequency_penalty=torch.zeros(2),
        repetition_penalty=torch.ones(2),
    )
    ops.sample(*base, **good)
    with pytest.raises(TypeError, match="token_bias"):
        ops.sample(*base, **{**good, "token_bias": torch.zeros(1, dtype=torch.float64)})
    with pytest.raises(ValueError, match="presence_penalty"):
        ops.sample(*base, **{**good, "presence_penalty": torch.zeros(3)})
    with pytest.raises(ValueError, match="bitmask"):
        ops.sample(*base, bitmask=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask"):
        ops.sample(
            *base,
            bitmask=torch.zeros(1, 2, dtype=torch.int32),
            bitmask_rows=torch.zeros(2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="top_ids"):
        ops.sample(
            *base, top_ids=torch.zeros(2, 21, dtype=torch.int32), top_logprobs=torch.zeros(2, 21)
        )
    with pytest.raises(ValueError, match="vocabulary"):  # N <= V (here V = 10)
        ops.sample(
            *base, top_ids=torch.zeros(2, 11, dtype=torch.int32), top_logprobs=torch.zeros(2, 11)
        )


def test_host_state_builds_sparse_entries_incrementally():
    params = SamplingParams(
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        logit_bias={9: 4.0, 3: -1.0},
        bad_words=[[11], [5, 6, 7]],
        min_tokens=3,
    )
    state = LogitsState(params, prompt_ids=[3, 4, 4], stop_ids=[2], vocab_size=20)
    out = []
    for token in (5, 6, 4):
        ids, counts, bias = state.entries(out)
        table = {i: (c, b) for i, c, b in zip(ids, counts, bias)}
        assert len(table) == len(ids), "ids are distinct within a row"
        assert table[3] == (out.count(3), -1.0) and table[9] == (-1, 4.0)
        assert table[11][1] == -math.inf and table[2][1] == -math.inf  # bad word, EOS < min_tokens
        assert (7 in table and table[7][1] == -math.inf) == (out[-2:] == [5, 6])
        assert table[4][0] == out.count(4)
        out.append(token)
        state.append(token)
    ids, counts, bias = state.entries(out)
    assert 2 not in ids, "EOS unmasked once min_tokens are generated"
    batch = batch_processing(
        [state, LogitsState(SamplingParams(), [1], [2], 20)],
        [out, []],
        [None, allowed_bitmask([1, 2], 20)],
    )
    a = batch.arrays
    assert a["token_offsets"].tolist() == [0, len(ids), len(ids)]
    assert a["bitmask_rows"].tolist() == [-1, 0] and a["bitmask"].tolist() == [[6]]
