"""The registered torch ops (ops/torch_library.py) on CUDA tensors: opcheck passes with the
kernels behind them (fake implementations agree with what the kernels return), the registered
call equals the direct one, and a Llama block of them compiles with fullgraph=True to the
eager result. The same checks run on the CPU in tests/test_torch_library.py."""

from __future__ import annotations

import pytest
import test_torch_library as cpu
import torch

pytestmark = pytest.mark.gpu

KERNEL_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_norms_and_activation(dtype):
    cpu.test_norms_and_activation(dtype, device="cuda")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_rope_and_cache(dtype):
    cpu.test_rope_and_cache(dtype, device="cuda")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_attention(dtype):
    cpu.test_attention(dtype, device="cuda")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_sampling(dtype):
    cpu.test_sampling(dtype, device="cuda")


def test_a_llama_block_compiles_fullgraph_to_the_eager_result():
    # aot_eager: the traced graph with the kernels as its custom ops; inductor's code generation
    # around them would cost a cold compile of a minute in a GPU check of ten
    cpu.test_a_llama_block_compiles_fullgraph_to_the_eager_result(
        device="cuda", dtype=torch.bfloat16, backend="aot_eager"
    )
