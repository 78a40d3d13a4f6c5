"""Shadow mode on the CUDA kernels (GPU only): an engine of the default model's shape, bfloat16,
serves a few requests (chunked prefill, prefix-cache hits, decode, a bf16 and an fp8 KV cache)
with every kernel call checked against its PyTorch reference in strict mode, so the first
divergence would stop the run and name step, layer, op and row. An engine-level verification of
every kernel the forward uses, on a real model shape; tools/gpu_stages.txt runs it as the
`shadow` stage."""

from __future__ import annotations

import pytest
import torch
from test_shadow import serve_strict

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_every_kernel_call_stays_within_its_reference_tolerance(kv_cache_dtype, capsys):
    report = serve_strict("synthetic:smollm2-135m", "cuda", "bfloat16", kv_cache_dtype)
    with capsys.disabled():
        print(f"\n{kv_cache_dtype} KV cache:\n{report.summary()}")
    torch.cuda.empty_cache()
