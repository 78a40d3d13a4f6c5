"""sample's logprob outputs agree with each other on every kernel variant (the emulated
kernels, tests/emulator): a sampled token that is in the top-N has exactly its top-N value, so a
greedy row's logprob is its top-1 to the bit. v2 computes the top-N with torch ops after its
kernels; its sampled tokens' logprobs once came from the kernel's own log-softmax, which rounds
apart from torch's (the first GPU run: up to 4e-7 on 4 to 7 of 24 greedy rows)."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason

import pagedkern

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.mark.parametrize("variant", ["v2", "v3", "v4"])
@pytest.mark.parametrize("dtype, vocab", [(torch.float32, 4097), (torch.bfloat16, 32000)])
def test_sampled_logprobs_equal_their_top_n_values(kernels, variant, dtype, vocab):
    kernels(sample=variant)
    rows, n = 16, 5
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temps = torch.tensor([0.0, 1.0] * (rows // 2))  # greedy and sampled rows
    seeds = torch.arange(rows) * 31 + 1
    out = torch.full((rows,), -1, dtype=torch.int32)
    lp = torch.full((rows,), float("nan"))
    top_ids = torch.full((rows, n), -1, dtype=torch.int32)
    top = torch.full((rows, n), float("nan"))
    with emulated():
        pagedkern.sample(
            logits, temps, 1.0, 0, seeds, 0, out, logprobs=lp, top_ids=top_ids, top_logprobs=top
        )
    greedy = temps <= 0
    assert torch.equal(top_ids[greedy, 0], out[greedy])
    torch.testing.assert_close(top[greedy, 0], lp[greedy], rtol=0, atol=0)
    hits = top_ids == out[:, None]
    assert int(hits[~greedy].sum()) >= 1  # some sampled rows drew a top-N token
    torch.testing.assert_close(top[hits], lp[hits.any(-1)], rtol=0, atol=0)
