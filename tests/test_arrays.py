"""Argument validation at the Python boundary, on any machine: bad input raises TypeError or
ValueError naming the argument with its shape and dtype, before anything reaches a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fake_cuda_array import FakeCudaArray

import pagedkern
from pagedkern.ops.arrays import rows_of, view


def test_view_of_torch_tensor_and_cai_object():
    t = torch.zeros(4, 6, dtype=torch.bfloat16)[:, 1:5]
    v = view(t, "x")
    assert (v.shape, v.strides, v.dtype, v.device, v.library) == (
        (4, 4),
        (6, 1),
        "bfloat16",
        "cpu",
        "torch",
    )
    f = view(FakeCudaArray((3, 8), "float16", strides=(16, 1)), "y")
    assert (f.shape, f.strides, f.dtype, f.device, f.library) == (
        (3, 8),
        (16, 1),
        "float16",
        None,
        "cai",
    )


def test_an_empty_array_is_contiguous():
    empty = torch.empty(3, 0)
    assert empty.stride() == (1, 1) and view(empty, "x").is_contiguous()
    assert not view(torch.empty(3, 2).T, "x").is_contiguous()


def test_rows_of_collapses_leading_dimensions():
    assert rows_of(view(torch.zeros(2, 3, 8), "x")) == (6, 8)
    assert rows_of(view(torch.zeros(5, 16)[:, :8], "x")) == (5, 16)
    with pytest.raises(ValueError, match="leading dimensions"):
        rows_of(view(torch.zeros(2, 3, 8).transpose(0, 1), "x"))
    with pytest.raises(ValueError, match=r"x \(shape \(8, 4\).*contiguous"):
        rows_of(view(torch.zeros(4, 8).t(), "x"))


def test_numpy_arrays_are_rejected_with_the_argument_name():
    with pytest.raises(TypeError, match="x must be a torch tensor, a CuPy array"):
        pagedkern.rms_norm(np.zeros((2, 4), np.float32), torch.ones(4))


@pytest.mark.parametrize(
    "call,error,message",
    [
        (
            lambda: pagedkern.rms_norm(FakeCudaArray((4, 8), "int32"), FakeCudaArray((8,))),
            TypeError,
            r"x \(shape \(4, 8\), dtype int32, cuda:\?\): dtype must be one of",
        ),
        (
            lambda: pagedkern.rms_norm(FakeCudaArray((4, 8)), FakeCudaArray((7,))),
            ValueError,
            r"weight \(shape \(7,\), dtype float16.*must have shape \(8,\)",
        ),
        (
            lambda: pagedkern.rms_norm(FakeCudaArray((4, 8)), FakeCudaArray((8,), "float32")),
            TypeError,
            r"weight .* must have the dtype of x",
        ),
        (
            lambda: pagedkern.rms_norm(FakeCudaArray((4, 8)), FakeCudaArray((8,)), eps=-1.0),
            ValueError,
            "eps must be a finite non-negative number",
        ),
        (
            lambda: pagedkern.rms_norm(
                FakeCudaArray((4, 8)), FakeCudaArray((8,)), out=FakeCudaArray((4, 9))
            ),
            ValueError,
            r"out \(shape \(4, 9\).*must have shape \(4, 8\)",
        ),
        (
            lambda: pagedkern.fused_add_rms_norm(
                FakeCudaArray((4, 8)), FakeCudaArray((4, 7)), FakeCudaArray((8,))
            ),
            ValueError,
            r"residual \(shape \(4, 7\).*must have shape \(4, 8\)",
        ),
        (
            lambda: pagedkern.silu_and_mul(FakeCudaArray((4, 7))),
            ValueError,
            r"x \(shape \(4, 7\).*must be even",
        ),
        (
            lambda: pagedkern.silu_and_mul(FakeCudaArray((4, 8)), out=FakeCudaArray((4, 8))),
            ValueError,
            r"out \(shape \(4, 8\).*must have shape \(4, 4\)",
        ),
        (
            lambda: pagedkern.silu_and_mul(FakeCudaArray((4, 8), strides=(1, 4))),
            ValueError,
            "last dimension must be contiguous",
        ),
        (
            lambda: pagedkern.rms_norm(torch.ones(2, 8, dtype=torch.float16), FakeCudaArray((8,))),
            ValueError,
            "must be on the same device",
        ),
    ],
)
def test_norm_and_activation_validation(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _attention_args(**changes):
    args = dict(
        q=FakeCudaArray((3, 8, 64)),
        k_cache=FakeCudaArray((10, 2, 16, 64)),
        v_cache=FakeCudaArray((10, 2, 16, 64)),
        block_tables=FakeCudaArray((3, 4), "int32"),
        seq_lens=FakeCudaArray((3,), "int32"),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,error,message",
    [
        (
            dict(q=FakeCudaArray((3, 8, 64), "int32")),
            TypeError,
            r"q \(shape \(3, 8, 64\), dtype int32",
        ),
        (
            dict(k_cache=FakeCudaArray((10, 3, 16, 64)), v_cache=FakeCudaArray((10, 3, 16, 64))),
            ValueError,
            "multiple of the KV heads",
        ),
        (
            dict(v_cache=FakeCudaArray((10, 2, 16, 64), "float32")),
            TypeError,
            "v_cache .* dtype of q",
        ),
        (dict(k_cache=FakeCudaArray((10, 2, 16, 32))), ValueError, r"k_cache .* must have shape"),
        (dict(block_tables=FakeCudaArray((3, 4), "int64")), TypeError, "block_tables .* int32"),
        (
            dict(seq_lens=FakeCudaArray((4,), "int32")),
            ValueError,
            r"block_tables .* must have shape \(4, \*\)",
        ),
        (
            dict(q=FakeCudaArray((3, 8, 64), strides=(1024, 128, 1))),
            ValueError,
            "heads must be packed",
        ),
    ],
)
def test_paged_attention_validation(changes, error, message):
    with pytest.raises(error, match=message):
        pagedkern.paged_attention(**_attention_args(**changes))


def test_flash_prefill_and_rope_and_sample_validation():
    with pytest.raises(TypeError, match="cu_seqlens_q .* int32"):
        pagedkern.flash_prefill(cu_seqlens_q=FakeCudaArray((4,), "int64"), **_attention_args())
    with pytest.raises(
        ValueError, match=r"block_tables \(shape \(3, 4\).*must have shape \(2, \*\)"
    ):
        pagedkern.flash_prefill(cu_seqlens_q=FakeCudaArray((3,), "int32"), **_attention_args())
    q, k = FakeCudaArray((5, 8, 64)), FakeCudaArray((5, 2, 64), offset=5 * 8 * 64)
    v = FakeCudaArray((5, 2, 64), offset=5 * 10 * 64)
    cache = FakeCudaArray((10, 2, 16, 64), offset=5 * 12 * 64)
    v_cache = FakeCudaArray((10, 2, 16, 64), offset=5 * 12 * 64 + 10 * 2 * 16 * 64)
    with pytest.raises(TypeError, match="positions .* int32"):
        pagedkern.rope_and_cache(
            q,
            k,
            v,
            FakeCudaArray((5,), "int64"),
            FakeCudaArray((100, 64), "float32"),
            cache,
            v_cache,
            FakeCudaArray((5,), "int32"),
        )
    with pytest.raises(ValueError, match=r"slot_mapping \(shape \(4,\)"):
        pagedkern.rope_and_cache(
            q,
            k,
            v,
            FakeCudaArray((5,), "int32"),
            FakeCudaArray((100, 64), "float32"),
            cache,
            v_cache,
            FakeCudaArray((4,), "int32"),
        )
    with pytest.raises(TypeError, match="top_k .* int32"):
        pagedkern.sample(
            FakeCudaArray((3, 100), "float32"), 1.0, 1.0, FakeCudaArray((3,), "int64"), 0
        )
    with pytest.raises(TypeError, match="seeds must be an int"):
        pagedkern.sample(torch.zeros(3, 100), 1.0, 1.0, 0, 0.5)


def test_valid_arguments_on_a_machine_without_gpu_raise_a_clear_error():
    if pagedkern.cuda_available():
        pytest.skip("this machine can run the kernels")
    with pytest.raises(pagedkern.CudaUnavailableError, match="cannot run CUDA kernels here: "):
        pagedkern.rms_norm(FakeCudaArray((4, 8)), FakeCudaArray((8,)), out=FakeCudaArray((4, 8)))
    with pytest.raises(pagedkern.CudaUnavailableError):
        pagedkern.silu_and_mul(FakeCudaArray((4, 8)), out=FakeCudaArray((4, 4)))


def test_cpu_tensors_run_on_the_reference():
    x, w = torch.randn(3, 10), torch.randn(10)
    torch.testing.assert_close(pagedkern.rms_norm(x, w), pagedkern.reference.rms_norm(x, w))
    y = torch.randn(3, 10)
    torch.testing.assert_close(pagedkern.silu_and_mul(y), pagedkern.reference.silu_and_mul(y))


@pytest.mark.parametrize("eps", [math.nan, math.inf, -1e-6, True, "1e-6"])
def test_eps_must_be_finite_and_non_negative(eps):
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="eps must be a finite non-negative number"):
        pagedkern.rms_norm(x, w, eps)
    with pytest.raises(ValueError, match="eps must be a finite non-negative number"):
        pagedkern.fused_add_rms_norm(x, x.clone(), w, eps)


def test_fused_add_rms_norm_rejects_aliased_x_and_residual():
    w = torch.ones(8)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"x \(shape \(4, 8\).* and residual .* overlap"):
        pagedkern.fused_add_rms_norm(x, x, w)  # reference path
    buf = torch.randn(4, 12)
    with pytest.raises(ValueError, match="overlap in memory"):
        pagedkern.fused_add_rms_norm(buf[:, :8], buf[:, 4:], w)
    with pytest.raises(ValueError, match="overlap in memory"):  # kernel path (CUDA arrays)
        pagedkern.fused_add_rms_norm(
            FakeCudaArray((4, 8)), FakeCudaArray((4, 8), offset=8), FakeCudaArray((8,))
        )
    halves = torch.randn(2, 4, 8)  # disjoint halves of one buffer are fine
    got = pagedkern.fused_add_rms_norm(halves[0].clone(), halves[1].clone(), w)
    assert pagedkern.fused_add_rms_norm(halves[0], halves[1], w)[0].equal(got[0])


def _paged_cpu(seq_lens=(5, 9), num_blocks=6, block_size=4, width=3):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(num_blocks, 2, block_size, 16, generator=g)
    q = torch.randn(len(seq_lens), 4, 16, generator=g)
    tables = torch.arange(len(seq_lens) * width, dtype=torch.int32).view(-1, width) % num_blocks
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t, s: t.__setitem__((1, 0), -1), r"block_tables\[1, 0\] = -1 is not a block id"),
        (lambda t, s: t.__setitem__((0, 1), 6), r"block_tables\[0, 1\] = 6 is not a block id"),
        (lambda t, s: s.__setitem__(1, 13), r"seq_lens\[1\] = 13 exceeds the block table's cap"),
        (lambda t, s: s.__setitem__(0, -2), r"seq_lens\[0\] = -2 is negative"),
    ],
)
def test_reference_attention_checks_index_contents(edit, message):
    # Before: a block id of -1 silently read the last block, seq_lens past the table gave an
    # IndexError naming nothing. Entries past a sequence's pages stay free (padding).
    q, cache, tables, lens = _paged_cpu()
    tables[0, 2] = -7  # unused padding entry: sequence 0 has 5 keys = 2 pages
    pagedkern.paged_attention(q, cache, cache, tables, lens)
    edit(tables, lens)
    with pytest.raises(ValueError, match=message):
        pagedkern.paged_attention(q, cache, cache, tables, lens)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        pagedkern.flash_prefill(q, cache, cache, cu, tables, lens)


@pytest.mark.parametrize(
    "cu, message",
    [
        ([1, 1, 2], r"cu_seqlens_q\[0\] = 1 must be 0"),
        ([0, 2, 1], r"cu_seqlens_q must not decrease"),
        ([0, 1, 3], r"cu_seqlens_q\[-1\] = 3 must equal the number of query rows 2"),
        ([0, 1, 1], r"cu_seqlens_q\[-1\] = 1 must equal"),
    ],
)
def test_reference_prefill_checks_query_bounds(cu, message):
    q, cache, tables, lens = _paged_cpu()
    with pytest.raises(ValueError, match=message):
        pagedkern.flash_prefill(q, cache, cache, torch.tensor(cu, dtype=torch.int32), tables, lens)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("positions", -1, r"positions\[2\] = -1 is outside the cos_sin table \(\[0, 32\)\)"),
        ("positions", 32, r"positions\[2\] = 32 is outside"),
        ("slots", -2, r"slot_mapping\[2\] = -2 is neither -1"),
        ("slots", 24, r"slot_mapping\[2\] = 24 is neither -1 \(no write\) nor a cache slot"),
    ],
)
def test_reference_rope_checks_positions_and_slots(field, value, message):
    # Before: a negative position wrapped to the end of the table, a slot past the cache
    # raised an IndexError naming nothing.
    from pagedkern.reference import cos_sin_cache

    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    cache = torch.zeros(6, 1, 4, 8)
    args = dict(positions=torch.arange(4, dtype=torch.int32), slots=torch.tensor([0, -1, 5, 23]))
    args["slots"] = args["slots"].int()
    args[field][2] = value
    with pytest.raises(ValueError, match=message):
        pagedkern.rope_and_cache(
            q, k, v, args["positions"], cos_sin_cache(8, 32), cache, cache.clone(), args["slots"]
        )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_arrays_an_op_writes_need_their_own_memory(backend):
    """A broadcast view (stride 0) written by an op: before, the CPU backend's rope_and_cache
    rotated the one row under an expanded q four times over (the caller's tensor changed), and
    an expanded attention `out` came back with only its last row right. Now refused, as are q
    and k being one array and the two caches one cache."""
    from pagedkern import ops
    from pagedkern.reference import cos_sin_cache

    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 4, 16, generator=g)
    k, v = torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    kc, vc = torch.zeros(6, 2, 4, 16), torch.zeros(6, 2, 4, 16)
    positions, slots = torch.arange(4, dtype=torch.int32), torch.tensor([0, 1, 5, 9]).int()
    cos_sin = cos_sin_cache(16, 32)
    q = torch.randn(4, 4, 16, generator=g)
    kept = base.clone()
    with ops.use_backend(backend):
        with pytest.raises(ValueError, match=r"q \(shape \(4, 4, 16\).*elements overlap"):
            ops.rope_and_cache(base.expand(4, 4, 16), k, v, positions, cos_sin, kc, vc, slots)
        with pytest.raises(ValueError, match=r"k \(shape \(4, 2, 16\).*elements overlap"):
            ops.rope_and_cache(
                q, base[:, :2].expand(4, 2, 16), v, positions, cos_sin, kc, vc, slots
            )
        with pytest.raises(ValueError, match="are one array"):
            ops.rope_and_cache(q[:, :2], q[:, :2], v, positions, cos_sin, kc, vc, slots)
        with pytest.raises(ValueError, match="overlap in memory"):
            ops.rope_and_cache(q, k, v, positions, cos_sin, kc, kc, slots)
        assert torch.equal(base, kept)
        qa, cache, tables, lens = _paged_cpu()
        out = torch.zeros(1, 4, 16).expand(2, 4, 16)
        with pytest.raises(ValueError, match=r"out \(shape \(2, 4, 16\).*elements overlap"):
            ops.paged_attention(qa, cache[:, :1], cache[:, 1:], tables, lens, out=out)
        x = torch.randn(4, 8)
        with pytest.raises(ValueError, match="elements overlap"):
            ops.rms_norm(x, torch.ones(8), out=torch.empty(1, 8).expand(4, 8))
        with pytest.raises(ValueError, match="elements overlap"):
            ops.silu_and_mul(torch.randn(4, 16), out=torch.empty(1, 8).expand(4, 8))
        # strided but disjoint outputs stay fine: a slice of a wider buffer
        wide = torch.zeros(4, 12)
        ops.rms_norm(x, torch.ones(8), out=wide[:, 2:10])
        assert wide[:, :2].eq(0).all() and wide[:, 10:].eq(0).all()
        torch.testing.assert_close(wide[:, 2:10], ops.rms_norm(x, torch.ones(8)))
