"""Piecewise graphs of mixed steps (engine/piecewise_graphs.py), proven on the CPU: the padded
static path (same buffers, padding and piece boundaries as on a GPU, run without capture) gives
the eager forward's logits and KV cache writes, the engine's greedy outputs do not change, and a
mixed step's host launches drop from ~10 per layer to the attention launches plus one replay per
piece (capture mocked: the pieces recorded, replayed as Python calls)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mixed_batches import mixed_batch

from pagedkern import ops
from pagedkern.engine import Engine, EngineConfig, SamplingParams
from pagedkern.engine.kernel_policy import piecewise_graphs
from pagedkern.engine.piecewise_graphs import Piece, PiecewiseGraphs, piecewise_token_sizes
from pagedkern.model import SequenceChunk, layout_batch, load_model
from pagedkern.ops import launch
from pagedkern.serving.cli import args as cli_args
from pagedkern.serving.cli import config_from_flags

BLOCK = 4
MAX_TOKENS = 128  # ladder 16, 32, 64, 128
MAX_SEQS = 16


@pytest.fixture(scope="module")
def model():
    model, _ = load_model("synthetic:tiny", "cpu", torch.float32)
    return model


def _caches(model, num_blocks: int = 256):
    """Two KV caches with the same random content (cached prefixes read real values)."""
    a = model.allocate_kv_cache(num_blocks, BLOCK)
    a.data.copy_(torch.randn(a.data.shape, generator=torch.Generator().manual_seed(3)))
    b = model.allocate_kv_cache(num_blocks, BLOCK)
    b.data.copy_(a.data)
    return a, b


def _mixed_batch(seed: int, prefill_lens: list[int], num_decodes: int) -> list[SequenceChunk]:
    return mixed_batch(seed, prefill_lens, num_decodes, BLOCK, vocab=512, max_prefix=30)


def _graphs(model, kv) -> PiecewiseGraphs:
    graphs = PiecewiseGraphs(model, kv, MAX_SEQS, MAX_TOKENS, max_model_len=512)
    for buffer in (graphs.residual, graphs.qkv, graphs.attn):
        buffer.fill_(float("nan"))  # poisoned: a padding or stale row reaching a real one shows
    return graphs


# (prefill chunk lengths, decodes, logit rows): token counts at and between ladder sizes,
# several prefills, a mid-prompt chunk that samples nothing (logit rows given), a prefill-only
# step; each samples >= 7 rows (see the next test for fewer).
CASES = {
    "16 = ladder": ([5, 3], 8, None),
    "17": ([9, 2], 6, None),
    "31": ([20], 11, None),
    "32 = ladder": ([7, 7, 7], 11, None),
    "33, mid-prompt chunk": ([13, 10], 10, [1, *range(2, 12)]),
    "100": ([40, 30, 19], 11, None),
    "128 = top": ([60, 60], 8, None),
    "prefill only, 47": ([3, 4, 4, 4, 4, 4, 24], 0, None),
}


@pytest.mark.parametrize("case", CASES)
def test_padded_static_piecewise_path_equals_eager_bitwise(model, case):
    prefill_lens, decodes, rows = CASES[case]
    chunks = _mixed_batch(len(case), prefill_lens, decodes)
    layout = layout_batch(chunks, BLOCK, logits_rows=rows)
    eager_kv, piecewise_kv = _caches(model)
    eager = model(*layout.upload(), eager_kv)
    graphs = _graphs(model, piecewise_kv)
    n = len(layout.input_ids)
    assert graphs.covers(layout) and graphs.bucket(n) >= n >= 16
    got = graphs.run(layout)
    assert not got.isnan().any()
    # The layers' GEMMs see n tokens eagerly and T padded ones here, the LM head its logit rows
    # and min(T, MAX_SEQS): the same bits wherever this BLAS gives a row the same bits at both
    # row counts (a Xeon's MKL from 7 rows on; an AMD EPYC's at 2 threads not at 7, 10 or 11),
    # else the few-row rounding of the next test.
    if gemm_rows_round_alike(model, _row_counts(graphs, n, len(got))):
        assert torch.equal(got, eager)
        assert torch.equal(piecewise_kv.data, eager_kv.data)  # the same k/v, no padding row
    else:
        _assert_within_rounding(got, eager, piecewise_kv, eager_kv)


@pytest.mark.parametrize("prefill_lens, decodes", [([3], 2), ([23, 24], 0)])
def test_few_rows_round_as_the_blas_does_for_few_rows(model, prefill_lens, decodes):
    # 5 tokens padded to 16, or 2 logit rows padded to 16: the BLAS takes a small-M path for
    # M < 7 that rounds differently from M = 16 (cuBLAS may pick its algorithm by M likewise):
    # equal within rounding, the same argmax.
    layout = layout_batch(_mixed_batch(1, prefill_lens, decodes), BLOCK)
    eager_kv, piecewise_kv = _caches(model)
    eager = model(*layout.upload(), eager_kv)
    got = _graphs(model, piecewise_kv).run(layout)
    _assert_within_rounding(got, eager, piecewise_kv, eager_kv)


def _assert_within_rounding(got, eager, piecewise_kv, eager_kv) -> None:
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(piecewise_kv.data, eager_kv.data, rtol=1e-5, atol=1e-5)


def _row_counts(graphs: PiecewiseGraphs, tokens: int, logit_rows: int) -> list[tuple[int, int]]:
    """(eager, padded) row counts of the step's GEMMs: the layers' and the LM head's."""
    padded = graphs.bucket(tokens)
    return [(tokens, padded), (logit_rows, min(padded, MAX_SEQS))]


def gemm_rows_round_alike(model, pairs: list[tuple[int, int]]) -> bool:
    """Whether this machine's BLAS gives a row of each of the model's GEMMs (layer 0's four and
    the LM head) the same bits in a product of m rows as in one of M rows, for each (m, M):
    measured on random rows, as the padded path needs it."""
    w = model.weights
    weights = [w.layers[0].qkv, w.layers[0].o, w.layers[0].gate_up, w.layers[0].down, w.lm_head]
    g = torch.Generator().manual_seed(0)
    for m, rows in pairs:
        for weight in weights:
            x = torch.randn(rows, weight.shape[1], generator=g)
            if not torch.equal(F.linear(x[:m], weight), F.linear(x, weight)[:m]):
                return False
    return True


def _record_as_python_calls(piece: Piece) -> Piece:
    """A mock of CUDA-graph capture: the replay runs the piece's Python, its launches hidden
    (they would be the driver's, inside the graph); run() counts the one replay."""

    def replay():
        with launch.count_launches():
            return piece()

    return replay


def test_a_mixed_step_launches_attention_and_one_replay_per_piece(model):
    # through pagedkern.ops, as on a GPU (the CPU backend's step table calls its functions
    # directly, which count no launches)
    with ops.use_backend("reference"):
        _mixed_step_launches(model)


def _mixed_step_launches(model):
    layout = layout_batch(_mixed_batch(2, [9, 6], 5), BLOCK)  # 20 tokens: 2 prefills, 5 decodes
    eager_kv, piecewise_kv = _caches(model)
    with launch.count_launches() as eager:
        expected = model(*layout.upload(), eager_kv)
    graphs = _graphs(model, piecewise_kv)
    graphs.capture(record=_record_as_python_calls)
    assert sorted(graphs._replays) == graphs.sizes == [16, 32, 64, 128]
    with launch.count_launches() as piecewise:
        got = graphs.run(layout)
    if gemm_rows_round_alike(model, _row_counts(graphs, len(layout.input_ids), len(got))):
        assert torch.equal(got, expected)
    else:
        _assert_within_rounding(got, expected, piecewise_kv, eager_kv)
    layers = model.config.num_layers
    attention = Counter({"rope_and_cache": layers, "flash_prefill": layers})
    attention["paged_attention"] = layers
    per_layer = {"gemm": 4, "fused_add_rms_norm": 2, "silu_and_mul": 1}  # + attention's 3
    assert eager == attention + Counter(
        {**{op: n * layers for op, n in per_layer.items()}, "embedding": 1, "rms_norm": 1}
    ) + Counter({"gemm": 1})  # the LM head
    assert sum(eager.values()) == 10 * layers + 3
    assert piecewise == attention + Counter({"graph_replay": layers + 1})


def test_the_launch_counter_counts_nothing_outside_its_block(model):
    layout = layout_batch(_mixed_batch(4, [3], 1), BLOCK)
    kv, _ = _caches(model)
    with launch.count_launches() as outer:
        with launch.count_launches() as inner:
            model(*layout.upload(), kv)
        launch.record_launch("x")
    model(*layout.upload(), kv)  # nobody counting: no error, nothing recorded
    assert inner["gemm"] == 4 * model.config.num_layers + 1
    assert outer == Counter({"x": 1})


def test_token_ladder():
    assert piecewise_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert piecewise_token_sizes(100) == [16, 32, 64, 100]
    assert piecewise_token_sizes(16) == [16]
    assert piecewise_token_sizes(5) == [5]


def test_a_step_the_graphs_do_not_cover_is_refused(model):
    kv, _ = _caches(model, 512)
    graphs = PiecewiseGraphs(model, kv, 4, 32, max_model_len=512)
    too_long = layout_batch(_mixed_batch(5, [30], 3), BLOCK)  # 33 tokens > 32
    too_many = layout_batch(_mixed_batch(5, [3], 4), BLOCK)  # 5 sequences > 4
    for layout in (too_long, too_many):
        assert not graphs.covers(layout)
        with pytest.raises(ValueError, match="not a step these piecewise graphs can run"):
            graphs.run(layout)


def test_policy_follows_decode_graphs_unless_turned_off():
    assert piecewise_graphs(decode_graphs=True, requested=None) is True
    assert piecewise_graphs(decode_graphs=False, requested=None) is False
    assert piecewise_graphs(decode_graphs=True, requested=False) is False
    with pytest.raises(ValueError, match="piecewise_cuda_graphs=True needs decode CUDA graphs"):
        piecewise_graphs(decode_graphs=False, requested=True)


def test_the_flag_reaches_engine_config():
    parse = cli_args.build_parser().parse_args
    assert config_from_flags.engine_config(parse(["hi"])).piecewise_cuda_graphs is None
    off = config_from_flags.engine_config(parse(["--no-piecewise-cuda-graphs", "hi"]))
    assert off.piecewise_cuda_graphs is False
    with pytest.raises(ValueError, match="piecewise_cuda_graphs"):
        EngineConfig(piecewise_cuda_graphs="yes")


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _engine_outputs(monkeypatch, **flags) -> tuple[list[list[int]], int]:
    """Greedy outputs of 12 prompts with chunked prefill (32-token steps), and how many steps
    ran piecewise."""
    runs = []
    run = PiecewiseGraphs.run
    monkeypatch.setattr(
        PiecewiseGraphs, "run", lambda self, layout: runs.append(1) or run(self, layout)
    )
    engine = Engine.from_config(
        EngineConfig(
            model="synthetic:tiny",
            backend="reference",
            num_blocks=512,
            block_size=BLOCK,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            **flags,
        )
    )
    rng = random.Random(11)
    prompts = [
        [rng.randrange(3, 500) for _ in range(rng.choice([2, 9, 17, 40, 75]))] for _ in range(12)
    ]
    requests = [engine.add_request(prompt_ids=p, params=GREEDY) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        engine.pool.check_invariants(engine.scheduler.block_tables())
    assert engine.pool.num_used == 0
    return [r.output_ids for r in requests], len(runs)


def test_engine_greedy_outputs_equal_with_piecewise_on_and_off(monkeypatch):
    eager, none = _engine_outputs(monkeypatch, cuda_graphs=False)
    decode_only, none_either = _engine_outputs(
        monkeypatch, cuda_graphs=True, piecewise_cuda_graphs=False
    )
    piecewise, ran = _engine_outputs(monkeypatch, cuda_graphs=True)  # piecewise by default
    assert none == none_either == 0 and ran >= 5  # the mixed steps went piecewise
    assert len({tuple(map(tuple, o)) for o in (eager, decode_only, piecewise)}) == 1
    assert len({tuple(o) for o in eager}) > 1
