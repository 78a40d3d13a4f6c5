"""Expert parallelism through the engine on the CPU (gloo, loopback, 2 ranks): with
expert_parallel=True at tensor_parallel_size 2 each rank holds whole experts (Mixtral's 5 split
3 / 2, Qwen3-MoE's 6 as 3 / 3) while attention and dense MLPs stay tensor-parallel, and greedy
decoding gives TP = 1's tokens (and logits within LOGITS_ATOL) for test_model_moe's tiny models
under chunked prefill, prefix hits and preemption (tensor_parallel_cases' workload); also with
the routers zeroed (every token to experts 0 and 1, both on rank 0, the others none), from a
GGUF with Q8_0 experts, and for gpt-oss (expert biases, clamped SwiGLU). A dense model
with expert_parallel runs as tensor parallelism alone (vLLM's flag is a no-op there too); fewer
experts than ranks is refused by name."""

from __future__ import annotations

import gguf
import pytest
import torch
from tensor_parallel_cases import LOGITS_ATOL, SETTINGS, greedy, mqa_folder, prompts, record_logits
from test_model_moe import ARCHITECTURES, _save, _zero_routers

from pagedkern.engine import LLM
from pagedkern.parallel import TensorParallelConfigError

transformers = pytest.importorskip("transformers")

SETTINGS_NONE = dict(SETTINGS, quantization="none")


def _qwen3_moe_q8():
    # every matrix's K a multiple of 32 (Q8_0 blocks); 3 experts (2 / 1), top-2
    from test_model_moe import COMMON

    return transformers.Qwen3MoeConfig(
        head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=3,
        num_experts_per_tok=2, norm_topk_prob=True, **COMMON,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKERN_CACHE_DIR", str(tmp_path / "cache"))


def assert_ep2_equals_tp1(path, count: int = 6, tokens: int = 8, **settings) -> None:
    """EP = 2's greedy tokens and sampled-row logits equal TP = 1's on `count` prompts (and rank
    0 holds whole experts, half of them rounded up, with attention split)."""
    settings = dict(SETTINGS_NONE, **settings)
    reference = LLM(path, **settings)
    ids = prompts(reference.engine.vocab_size)[:count]
    want_logits = record_logits(reference)
    want = reference.generate(ids, greedy(tokens), use_tqdm=False)
    full = reference.engine.model.config
    with LLM(path, tensor_parallel_size=2, expert_parallel=True, **settings) as parallel:
        model = parallel.engine.model
        assert model.tp.expert_parallel and "with whole experts" in model.describe()
        assert model.local.moe_intermediate_size == full.moe_intermediate_size  # whole experts
        assert model.local.num_heads * 2 == full.num_heads  # attention still split
        moe = [w for w in model.weights.layers if w.router is not None]
        assert moe and all(w.experts_gate_up.shape[0] == -(-full.num_experts // 2) for w in moe)
        got_logits = record_logits(parallel)
        got = parallel.generate(ids, greedy(tokens), use_tqdm=False)
    assert all(g.error is None for g in got), [g.error for g in got]
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert len(got_logits) == len(want_logits) > len(ids)
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits, strict=True))
    assert worst <= LOGITS_ATOL, worst


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_ep2_greedy_equals_tp1(tmp_path, arch):
    # Qwen3-MoE: a dense layer (TP-split) between two MoE layers; Mixtral: 5 experts, 3 / 2
    make_config, model_class = ARCHITECTURES[arch]
    _save(tmp_path, make_config, model_class)
    assert_ep2_equals_tp1(str(tmp_path))


def test_ep2_with_every_token_on_one_ranks_experts(tmp_path):
    # zero routers: equal logits, ties to the lower ids, so experts 0 and 1 (rank 0's) receive
    # every token and rank 1's experts none: rank 1 only sends and gets its rows back
    make_config, model_class = ARCHITECTURES["mixtral"]
    _save(tmp_path, make_config, model_class, _zero_routers)
    assert_ep2_equals_tp1(str(tmp_path), count=4)


@pytest.mark.slow  # ~12 s: the shared expert (TP-split) beside whole routed experts
def test_ep2_with_a_shared_expert(tmp_path):
    make_config, model_class = ARCHITECTURES["qwen2_moe"]
    _save(tmp_path, make_config, model_class)
    assert_ep2_equals_tp1(str(tmp_path), count=4)


def test_ep2_from_a_gguf(tmp_path):
    # each rank cuts its experts' rows of Q8_0 blocks out of the mapped ffn_*_exps tensors
    # (dequantized after the cut here; kept int8: test_expert_parallel_loading)
    from test_model_moe_gguf import write_moe_gguf

    hf = _save(tmp_path / "hf", _qwen3_moe_q8, "Qwen3MoeForCausalLM")
    path = tmp_path / "m.gguf"
    write_moe_gguf(path, hf, "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    assert_ep2_equals_tp1(str(path), count=4)


@pytest.mark.slow  # ~15 s: the gpt-oss checkpoint and two engines
def test_ep2_gpt_oss(tmp_path):
    from test_model_gguf_gpt_oss import ROPE, _llama_cpp_experts
    from test_model_gpt_oss import save

    save(tmp_path, _llama_cpp_experts, swiglu_limit=7.0, rope_parameters=ROPE)
    assert_ep2_equals_tp1(str(tmp_path), count=4, kv_per_kind_tables=False)


def test_a_dense_model_with_expert_parallel_is_tensor_parallel(tmp_path):
    folder = mqa_folder(tmp_path / "mqa")
    settings = dict(SETTINGS_NONE)
    reference = LLM(folder, **settings)
    ids = prompts(reference.engine.vocab_size)[:3]
    want = reference.generate(ids, greedy(6), use_tqdm=False)
    with LLM(folder, tensor_parallel_size=2, expert_parallel=True, **settings) as parallel:
        got = parallel.generate(ids, greedy(6), use_tqdm=False)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_fewer_experts_than_ranks_is_refused(tmp_path):
    from pagedkern.model import load_model
    from pagedkern.model.tensor_shard import TensorShard

    make_config, model_class = ARCHITECTURES["qwen3_moe_step2"]  # 3 experts
    _save(tmp_path, make_config, model_class)
    with pytest.raises(TensorParallelConfigError, match="only 3 experts"):
        load_model(str(tmp_path), "cpu", torch.float32, shard=TensorShard(0, 4, True))


def test_the_cli_flag_and_the_config_field():
    from pagedkern.engine import EngineConfig
    from pagedkern.engine.validation import ParameterTypeError
    from pagedkern.serving.cli.args import build_parser
    from pagedkern.serving.cli.config_from_flags import engine_config

    parse = build_parser().parse_args
    args = parse(["--model", "m", "--tensor-parallel-size", "2", "--expert-parallel"])
    config = engine_config(args)
    assert config.expert_parallel is True and config.tensor_parallel_size == 2
    assert engine_config(parse(["--model", "m"])).expert_parallel is False
    with pytest.raises(ParameterTypeError, match="expert_parallel"):
        EngineConfig(expert_parallel="yes")
