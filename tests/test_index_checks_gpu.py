"""The kernels' debug-mode index checks on a GPU (PAGEDKERN_CHECK_INDICES=1): an out-of-range
block id, slot or position makes the launch fail instead of reading or writing another request's
pages. A trap poisons the CUDA context, so each case runs in its own process; a valid call in the
same process shows the failure is the check's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SETUP = """
import torch, pagedkern
from pagedkern.reference import cos_sin_cache
dev, h = "cuda", torch.float16
k = torch.randn(8, 2, 16, 64, device=dev).to(h)
v = torch.randn_like(k)
tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=dev)
lens = torch.tensor([40, 9], dtype=torch.int32, device=dev)
q = torch.randn(2, 4, 64, device=dev).to(h)
cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
pos = torch.arange(2, dtype=torch.int32, device=dev)
slots = torch.tensor([0, 17], dtype=torch.int32, device=dev)
cos_sin = cos_sin_cache(64, 128, device=dev)
def rope():
    pagedkern.rope_and_cache(q.clone(), q[:, :2].clone(), q[:, :2].clone(), pos, cos_sin,
                             k, v, slots)
pagedkern.paged_attention(q, k, v, tables, lens)  # the valid calls run
pagedkern.flash_prefill(q, k, v, cu, tables, lens)
rope()
torch.cuda.synchronize()
print("valid ok", flush=True)
"""

CASES = {
    "decode_block_id": "tables[1, 0] = 8\npagedkern.paged_attention(q, k, v, tables, lens)",
    "decode_minus_one": "tables[0, 2] = -1\npagedkern.paged_attention(q, k, v, tables, lens)",
    "decode_seq_len": "lens[0] = 49\npagedkern.paged_attention(q, k, v, tables, lens)",
    "prefill_block_id": "tables[0, 1] = 99\npagedkern.flash_prefill(q, k, v, cu, tables, lens)",
    "prefill_cu_seqlens": "cu[2] = 3\npagedkern.flash_prefill(q, k, v, cu, tables, lens)",
    "rope_slot": "slots[1] = 8 * 16\nrope()",
    "rope_position": "pos[0] = 128\nrope()",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_out_of_range_indices_fail_the_launch(case):
    code = SETUP + textwrap.dedent(CASES[case]) + "\ntorch.cuda.synchronize()\nprint('no trap')\n"
    env = {**os.environ, "PAGEDKERN_CHECK_INDICES": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "valid ok" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode != 0 and "no trap" not in proc.stdout, proc.stdout
    assert "CUDA" in proc.stderr or "cuda" in proc.stderr, proc.stderr[-2000:]
