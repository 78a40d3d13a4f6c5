"""sample's processing indices on the kernels (the emulated .cu sources, tests/emulator): the
CUDA path reads no index back to the host, so the kernels bound them themselves. A bitmask row
past the bitmask or token_offsets that do not rise within [0, nnz] trap in debug mode
(PAGEDKERN_CHECK_INDICES=1, the tests' default); with the checks off such a row reads nothing
outside the arrays (no mask, no entries) and every other row draws the reference's id."""

from __future__ import annotations

import pytest
import torch
from emulator import emulated, unavailable_reason
from test_kernels_emulated import _processing_case

import pagedkern
from pagedkern import reference
from pagedkern.ops import sampling as ops_sampling

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
ROWS, VOCAB = 8, 203
BAD = ["mask row past the bitmask", "negative offset", "decreasing offsets", "offset past nnz"]


@pytest.fixture(params=["v2", "v3", "v4"])
def variant(request, monkeypatch, kernels):
    kernels(sample=request.param)
    if request.param == "v4":  # three CTAs a row, whatever the sizes
        monkeypatch.setattr(ops_sampling, "split_slices", lambda *args: 3)
    return request.param


def _case(bad: str):
    """(logits, temperatures, seeds, processing with one bad index, the bad rows)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 2
    processing = _processing_case(ROWS, VOCAB, g)
    offsets = processing["token_offsets"]
    offsets[1:] = torch.arange(1, ROWS + 1, dtype=torch.int32) * 3  # three entries a row
    n = int(offsets[-1])
    processing["token_ids"] = torch.stack([torch.randperm(VOCAB)[:3] for _ in range(ROWS)])
    processing["token_ids"] = processing["token_ids"].flatten().int()
    processing["token_counts"] = torch.randint(-1, 4, (n,), generator=g, dtype=torch.int32)
    processing["token_bias"] = torch.randn(n, generator=g) * 3
    bad_rows: list[int] = []
    if bad == "mask row past the bitmask":
        processing["bitmask_rows"][3] = 1 << 24
        bad_rows = [3]
    elif bad == "negative offset":
        offsets[2] = -6  # rows 1 and 2
        bad_rows = [1, 2]
    elif bad == "decreasing offsets":
        offsets[4] = 2  # rows 3 (9 -> 2) and 4 (2 -> 15)
        bad_rows = [3, 4]
    else:
        offsets[ROWS] = n + 40  # the last row
        bad_rows = [ROWS - 1]
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5])
    seeds = torch.randint(0, 2**62, (ROWS,), generator=g)
    return logits, temps, seeds, processing, bad_rows


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_processing_index_traps_in_debug_mode(variant, bad):
    logits, temps, seeds, processing, _ = _case(bad)
    out = torch.full((ROWS,), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="__trap"), emulated():
        pagedkern.sample(logits, temps, 0.9, 0, seeds, 0, out=out, **processing)


@pytest.mark.parametrize("bad", BAD)
def test_with_the_checks_off_a_bad_row_reads_nothing_outside(monkeypatch, variant, bad):
    monkeypatch.setenv("PAGEDKERN_CHECK_INDICES", "0")
    logits, temps, seeds, processing, bad_rows = _case(bad)
    out = torch.full((ROWS,), -1, dtype=torch.int32)
    with emulated():
        pagedkern.sample(logits, temps, 0.9, 0, seeds, 0, out=out, **processing)
    # the reference of the same rows with the bad rows' mask or entries dropped
    fixed = dict(processing)
    if bad == "mask row past the bitmask":
        fixed["bitmask_rows"] = processing["bitmask_rows"].clone()
        fixed["bitmask_rows"][bad_rows] = -1
    else:
        keep = [r for r in range(ROWS) if r not in bad_rows]
        spans = [(3 * r, 3 * r + 3) for r in range(ROWS)]
        entries = [j for r in keep for j in range(*spans[r])]
        counts = [3 if r in keep else 0 for r in range(ROWS)]
        fixed["token_offsets"] = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        fixed["token_offsets"] = fixed["token_offsets"].int()
        for name in ("token_ids", "token_counts", "token_bias"):
            fixed[name] = processing[name][entries]
    want = reference.sample(logits, temps, 0.9, 0, seeds, 0, **fixed)
    assert out.tolist() == want.tolist()
