"""csrc/rejection_sampling.cu run on the CPU through the emulator (tests/emulator) against
reference.rejection_sample: draw for draw (the kernel's acceptance test is the reference's float64
expression and its draw the same inverse CDF in vocabulary order), on the vector and scalar
paths, one chunk and several, point-mass and random drafts, degenerate rows; one launch per call;
poisoned outputs fully written; bad indices trap in debug mode and stay inside their request
outside it. Skipped where the emulator cannot be built."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, launches, unavailable_reason
from test_rejection_sampling import random_case

from pagedkern import ops, reference

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _poisoned(batch: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((batch, cols), -7, dtype=torch.int32),
        torch.full((batch,), -7, dtype=torch.int32),
    )


def _truncated(g, case):
    """The case's target rows as the sampler's distributions: top-k 5 / top-p 0.8 processed."""
    target, ids, q, cu, seeds, offsets = case
    logits = torch.randn(target.shape, generator=g) * 2
    half = target.shape[0] // 2
    target = torch.cat(
        [
            reference.sampling_distribution(logits[:half], 0.7, 1.0, 5),
            reference.sampling_distribution(logits[half:], 0.9, 0.8, 0),
        ]
    )
    return (target, ids, q, cu, seeds, offsets)


# (vocab, batch, max k, point mass): 200 and 20000 take the 16-byte path (one chunk of 8192
# ids, three chunks), 203 and 9001 the scalar path.
CASES = [(200, 24, 4, False), (200, 24, 4, True), (203, 16, 3, False), (203, 16, 5, True),
         (20000, 5, 3, False), (9001, 6, 3, True)]  # fmt: skip


@pytest.mark.parametrize("vocab, batch, max_k, point_mass", CASES)
def test_kernel_draws_the_reference_tokens(vocab, batch, max_k, point_mass):
    g = torch.Generator().manual_seed(vocab + batch + point_mass)
    case = random_case(g, batch, vocab, max_k, point_mass)
    if vocab < 1000:
        case = _truncated(g, case)
    target, ids, q, cu, seeds, offsets = case
    for b in range(0, batch, 2):  # proposals the target likes: acceptances, bonus tokens
        for j in range(int(cu[b + 1] - cu[b])):
            row = target[int(cu[b]) + b + j]
            row[int(ids[int(cu[b]) + j])] += 4 * row.sum()
            row /= row.sum()
    target[1] = 0.0  # no mass: every proposal there rejected, the id V - 1
    if q is not None:
        for j in range(int(cu[3] - cu[2])):  # q = 2 p: an empty residual, the draw falls back to p
            q[int(cu[2]) + j] = 2 * target[int(cu[2]) + 2 + j]
    case = (target.float(), ids, None if q is None else q.float(), cu, seeds, offsets)
    ref_tokens, ref_num = reference.rejection_sample(*case)
    out, num = _poisoned(batch, ref_tokens.shape[1])
    before = launches()
    with emulated():
        result = ops.rejection_sample(*case, out_token_ids=out, out_num_tokens=num)
    assert launches() == before + 1
    assert result[0] is out and result[1] is num
    assert torch.equal(num, ref_num) and torch.equal(out, ref_tokens)
    assert int((ref_num < (cu[1:] - cu[:-1] + 1)).sum()) > 0  # some rejections were exercised
    assert int((ref_num > 1).sum()) > 0  # and some acceptances


def test_kernel_sizes_its_own_outputs_and_pads_wide_ones():
    g = torch.Generator().manual_seed(3)
    target, ids, q, cu, seeds, offsets = random_case(g, 10, 64, 3, False)
    case = (target.float(), ids, q.float(), cu, seeds, offsets)
    ref = reference.rejection_sample(*case)
    with emulated():
        tokens, num = ops.rejection_sample(*case)
    assert torch.equal(tokens, ref[0]) and torch.equal(num, ref[1])
    out, out_num = _poisoned(10, ref[0].shape[1] + 3)  # wider than max k + 1: -1 past the end
    with emulated():
        ops.rejection_sample(*case, out_token_ids=out, out_num_tokens=out_num)
    assert (
        torch.equal(out[:, : ref[0].shape[1]], ref[0]) and (out[:, ref[0].shape[1] :] == -1).all()
    )


def test_no_proposals_draws_the_sample_token():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(20, 300, generator=g) * 2
    target = reference.sampling_distribution(logits, 0.8, 0.9, 0).float()
    seeds, offsets = torch.arange(20) * 7919 + 2**33, torch.arange(20, dtype=torch.int64)
    cu = torch.zeros(21, dtype=torch.int32)
    with emulated():
        tokens, num = ops.rejection_sample(
            target, torch.zeros(0, dtype=torch.int32), None, cu, seeds, offsets
        )
    assert (num == 1).all() and tokens.shape == (20, 1)
    assert tokens[:, 0].tolist() == reference.sample(logits, 0.8, 0.9, 0, seeds, offsets).tolist()


def _bad_case():
    g = torch.Generator().manual_seed(4)
    target, ids, q, cu, seeds, offsets = random_case(g, 3, 32, 2, True, zeros=0.0)
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    ids = torch.randint(0, 32, (6,), generator=g, dtype=torch.int32)
    target = torch.rand(9, 32, generator=g)
    return [target / target.sum(-1, keepdim=True), ids, None, cu, seeds, offsets]


@pytest.mark.parametrize("bad", ["draft id past the vocabulary", "negative draft id",
                                 "decreasing cu_draft", "k past the output width"])  # fmt: skip
def test_bad_indices_trap_in_debug_mode(bad):
    # With the outputs given nothing is read back to the host: the kernel checks on the device.
    case = _bad_case()
    if bad == "draft id past the vocabulary":
        case[1][3] = 32
    elif bad == "negative draft id":
        case[1][0] = -1
    elif bad == "decreasing cu_draft":
        case[3][1] = 5
    out, num = _poisoned(3, 2 if bad == "k past the output width" else 3)
    with pytest.raises(RuntimeError, match="__trap"), emulated():
        ops.rejection_sample(*case, out_token_ids=out, out_num_tokens=num)


def test_bad_indices_stay_inside_their_request_when_checks_are_off(monkeypatch):
    # Debug mode off: an out-of-vocabulary proposal is rejected without being read, and a
    # request with inconsistent cu_draft entries gets -1s and 0 tokens; the others are intact.
    monkeypatch.setenv("PAGEDKERN_CHECK_INDICES", "0")
    case = _bad_case()
    case[1][2] = 1 << 30  # request 1's first proposal
    ref = reference.rejection_sample(*case[:1], case[1].clamp(max=31), *case[2:])
    out, num = _poisoned(3, 3)
    with emulated():
        ops.rejection_sample(*case, out_token_ids=out, out_num_tokens=num)
    assert int(num[1]) == 1 and 0 <= int(out[1, 0]) < 32 and out[1, 1:].tolist() == [-1, -1]
    for b in (0, 2):
        assert out[b].tolist() == ref[0][b].tolist() and int(num[b]) == int(ref[1][b])
    case[3] = torch.tensor([0, 2, 1, 6], dtype=torch.int32)  # request 1: 2 -> 1, request 2: 1 -> 6
    out, num = _poisoned(3, 6)
    with emulated():
        ops.rejection_sample(*case, out_token_ids=out, out_num_tokens=num)
    assert int(num[1]) == 0 and (out[1] == -1).all()
    assert int(num[0]) >= 1 and out[0].tolist()[: int(num[0])] == ref[0][0].tolist()[: int(num[0])]


def test_under_graph_capture_the_outputs_must_be_given(monkeypatch):
    """Without outputs the op reads cu_draft back to size them: a device sync, illegal (or stale)
    inside a CUDA graph capture, so it is a clear error there; with outputs it runs as usual."""
    g = torch.Generator().manual_seed(5)
    target, ids, q, cu, seeds, offsets = random_case(g, 4, 200, 3, False)
    case = (target.float(), ids, q.float(), cu, seeds, offsets)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with emulated():
        before = launches()
        with pytest.raises(ValueError, match="CUDA graph capture"):
            ops.rejection_sample(*case)
        assert launches() == before
        out, num = _poisoned(4, 4)
        ops.rejection_sample(*case, out_token_ids=out, out_num_tokens=num)
    want_tokens, want_num = reference.rejection_sample(*case)
    assert torch.equal(num, want_num)
