"""rejection_sample kernel on the GPU vs reference.rejection_sample: draw for draw on odd shapes up
to Llama 3's V = 128256 (vector and scalar paths, point-mass and random drafts, outputs poisoned
beforehand or sized by the op), the emitted-token distributions over 2^18 requests, NaN rows kept
inside the vocabulary, and CUDA-graph capture with given outputs (nothing read back)."""

from __future__ import annotations

import math

import pytest
import torch
from test_rejection_sampling import random_case

from pagedkern import ops, reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


def _case(seed, batch, vocab, max_k, point_mass):
    g = torch.Generator().manual_seed(seed)
    target, ids, q, cu, seeds, offsets = random_case(g, batch, vocab, max_k, point_mass)
    for b in range(0, batch, 2):  # proposals the target likes: acceptances and bonus tokens
        for j in range(int(cu[b + 1] - cu[b])):
            row = target[int(cu[b]) + b + j]
            row[int(ids[int(cu[b]) + j])] += 4 * row.sum()
            row /= row.sum()
    return (target.float(), ids, None if q is None else q.float(), cu, seeds, offsets)


def _to(case, device):
    return tuple(None if t is None else t.to(device) for t in case)


# (vocab, batch, max k, point mass, outputs given)
SHAPES = [(1, 5, 3, True, True), (3, 7, 4, False, True), (203, 33, 5, False, True),
          (1000, 64, 4, True, False), (32000, 17, 4, False, True), (32001, 9, 2, True, True),
          (128256, 64, 4, False, True), (128256, 64, 4, True, False)]  # fmt: skip


@pytest.mark.parametrize("vocab, batch, max_k, point_mass, given", SHAPES)
def test_draws_equal_the_reference(vocab, batch, max_k, point_mass, given):
    case = _case(vocab + batch, batch, vocab, max_k, point_mass)
    ref_tokens, ref_num = reference.rejection_sample(*case)
    args = _to(case, DEVICE)
    if given:
        out = torch.full((batch, ref_tokens.shape[1] + 1), -7, dtype=torch.int32, device=DEVICE)
        num = torch.full((batch,), -7, dtype=torch.int32, device=DEVICE)
        tokens, n = ops.rejection_sample(*args, out_token_ids=out, out_num_tokens=num)
        assert tokens is out and n is num
        assert (out[:, -1] == -1).all()
        tokens = tokens[:, :-1]
    else:
        tokens, n = ops.rejection_sample(*args)
    assert torch.equal(n.cpu(), ref_num) and torch.equal(tokens.cpu(), ref_tokens)


def test_emitted_tokens_follow_the_target_distribution():
    # 2^18 requests sharing K + 1 = 3 target rows of V = 1000 (top-p 0.9 at temperature 0.7)
    # and a draft distribution; proposals drawn from the draft.
    n, k, vocab = 1 << 18, 2, 1000
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(k + 1, vocab, generator=g) * 3
    p = reference.sampling_distribution(logits, 0.7, 0.9, 0).float()
    q = reference.sampling_distribution(
        logits[:k] + torch.randn(k, vocab, generator=g), 1.0, 1.0, 0
    )
    q = q.float().to(DEVICE)
    ids = torch.stack(
        [torch.multinomial(q[j], n, replacement=True) for j in range(k)], 1
    ).int()  # x_j ~ q_j
    cu = (torch.arange(n + 1, device=DEVICE) * k).int()
    seeds = torch.arange(n, device=DEVICE) * 1000003 + 5
    offsets = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    target = p.to(DEVICE).repeat(n, 1)
    tokens, num = ops.rejection_sample(target, ids.reshape(-1), q.repeat(n, 1), cu, seeds, offsets)
    expected = p.double() / p.double().sum(-1, keepdim=True)
    for j, mask in [(0, num >= 1), (1, num >= 2), (2, num >= 3)]:
        drawn = tokens[mask, j].long()
        freq = torch.bincount(drawn, minlength=vocab).double().cpu() / drawn.numel()
        assert (freq[expected[j] == 0] == 0).all(), "a token outside the target's support"
        kept = int((expected[j] > 0).sum())
        bound = math.sqrt((kept * math.log(2) + math.log(1e9)) / (2 * drawn.numel()))
        assert 0.5 * float((freq - expected[j]).abs().sum()) < bound, j


def test_nan_and_zero_rows_stay_inside_the_vocabulary():
    target, ids, q, cu, seeds, offsets = _case(5, 40, 4096, 3, False)
    target[::3, ::7] = math.nan
    q[::2, ::5] = math.nan
    target[4] = 0.0
    tokens, num = ops.rejection_sample(*_to((target, ids, q, cu, seeds, offsets), DEVICE))
    ks = (cu[1:] - cu[:-1]).to(DEVICE)
    assert ((num >= 1) & (num <= ks + 1)).all()
    last = tokens.gather(1, (num.long() - 1)[:, None])
    assert ((last >= 0) & (last < 4096)).all()


def test_cuda_graph_replay_with_given_outputs():
    args = _to(_case(11, 32, 32000, 4, False), DEVICE)
    out = torch.full((32, 5), -7, dtype=torch.int32, device=DEVICE)
    num = torch.full((32,), -7, dtype=torch.int32, device=DEVICE)
    expected = ops.rejection_sample(*args)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.rejection_sample(*args, out_token_ids=out, out_num_tokens=num)  # warm-up
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    out.fill_(-7)
    with torch.cuda.graph(graph):
        ops.rejection_sample(*args, out_token_ids=out, out_num_tokens=num)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected[0]) and torch.equal(num, expected[1])
