"""The CPU decode step (model/cpu_decode.py) on the CPU backend: its attention is the backend's
tiles, so past one tile of keys (256) it still equals the plain forward's decode rows bit for
bit; under the reference backend it steps aside there (the reference's function is then the
plain path's only)."""

from __future__ import annotations

import pytest
from test_cpu_decode import _assert_fast_equals_plain, _model, _prefilled

from pagedkern import ops
from pagedkern.model import cpu_decode, load_model


@pytest.mark.parametrize("lengths", [[300], [5, 600, 270]])
def test_fast_decode_equals_plain_across_key_tiles(lengths):
    with ops.use_backend("cpu"):
        _assert_fast_equals_plain(_model("none"), lengths)


def test_fast_decode_over_an_fp8_cache_across_key_tiles():
    model, _ = load_model("synthetic:tiny", kv_cache_dtype="fp8")
    with ops.use_backend("cpu"):
        _assert_fast_equals_plain(model, [3, 520])


def test_the_reference_backend_takes_the_plain_path_past_one_tile():
    model = _model("none")
    kv, (_, meta) = _prefilled(model, [5, 300])
    model.fast_cpu_decode = True
    with ops.use_backend("reference"):
        assert not cpu_decode.applies(model, meta, kv)
    for backend in ("cpu", "auto"):
        with ops.use_backend(backend):
            assert cpu_decode.applies(model, meta, kv)
    kv, (_, meta) = _prefilled(model, [5, 200])
    with ops.use_backend("reference"):
        assert cpu_decode.applies(model, meta, kv)
