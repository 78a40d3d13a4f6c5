"""Bad input never kills the engine or fails anyone else:
admission refuses it with a ValueError naming the field, and a request that still breaks a
step fails alone while its neighbours get exactly what they would have got without it."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkern.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    ParameterTypeError,
    RequestRejected,
    SamplingParams,
)
from pagedkern.engine.sampling_params import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 27))  # 24 ids: 6 full blocks of 4 (the prefix cache hashes them)
OTHER = list(range(40, 61))


def make_engine(**overrides) -> Engine:
    config = dict(model="synthetic:tiny", backend="reference", num_blocks=128, block_size=4)
    config.update(overrides)
    return Engine.from_config(EngineConfig(**config))


@pytest.fixture(scope="module")
def solo() -> list[int]:
    """What OTHER gets alone."""
    engine = make_engine()
    out = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    list(engine.run_until_done())
    return list(out.output_ids)


def run(engine: Engine) -> dict[str, list]:
    """Every output by request id, checking the pool after every step."""
    outputs: dict[str, list] = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.pool.check_invariants(engine.scheduler.block_tables())
    assert not engine.has_unfinished and engine.pool.num_used == 0
    return outputs


def ids_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


# --- defect 1: a token id >= 2^63 crashed the engine thread -------------------------------------
def test_a_token_id_past_int64_is_refused_and_the_engine_serves_on(solo):
    engine = make_engine()
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] = 9223372036854775808"):
        engine.add_request(prompt_ids=[2**63, *PROMPT])
    good = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    assert ids_of(run(engine)[good.request_id]) == solo


def test_a_request_that_breaks_scheduling_fails_alone(solo):
    # Bypass admission: the prefix-cache hash of a token past int64 overflows in schedule().
    engine = make_engine()
    bad = engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    bad.prompt_ids = type(bad.prompt_ids)([2**63, *PROMPT])
    good = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    outputs = run(engine)  # on the old engine step() raised OverflowError here, and ever after
    assert [o.finish_reason for o in outputs[bad.request_id]] == [FinishReason.ERROR]
    assert "OverflowError" in outputs[bad.request_id][0].error
    assert ids_of(outputs[good.request_id]) == solo
    again = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    assert ids_of(run(engine)[again.request_id]) == solo  # still usable


def test_a_request_that_breaks_the_forward_pass_fails_alone(solo):
    # Bypass admission with a seed past int64: the sampler's parameter upload overflows, which
    # failed every request of the batch before.
    engine = make_engine()
    bad = engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    bad.seed = 2**64
    good = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    outputs = run(engine)
    assert [o.finish_reason for o in outputs[bad.request_id]] == [FinishReason.ERROR]
    assert ids_of(outputs[good.request_id]) == solo
    assert outputs[good.request_id][-1].finish_reason is FinishReason.LENGTH


def test_a_request_whose_output_processing_fails_fails_alone(solo):
    engine = make_engine()
    bad = engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    good = engine.add_request(prompt_ids=OTHER, params=GREEDY)

    def broken(token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken tokenizer")

    bad.detokenizer.add = broken
    outputs = run(engine)
    assert [o.finish_reason for o in outputs[bad.request_id]] == [FinishReason.ERROR]
    assert "UnicodeDecodeError" in outputs[bad.request_id][0].error
    assert ids_of(outputs[good.request_id]) == solo


def test_a_failure_nobody_can_be_blamed_for_fails_the_step_and_the_engine_lives_on(
    solo, monkeypatch
):
    engine = make_engine()
    first = engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    engine.step()  # first is running now
    real = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: 1 / 0)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        (first.request_id, FinishReason.ERROR)
    ]
    assert "ZeroDivisionError" in outputs[0].error and engine.pool.num_used == 0
    monkeypatch.setattr(engine.scheduler, "schedule", real)
    good = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    assert ids_of(run(engine)[good.request_id]) == solo


# --- defect 2 and 8: validation at admission, naming the field ----------------------------------
@pytest.mark.parametrize(
    "fields,name",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": -(2**31) - 1}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"timeout": math.inf}, "timeout"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_LENGTH + 1)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ],
)
def test_out_of_range_sampling_params_are_value_errors_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"top_k": "5"}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"stop": 5}, "stop"),
        ({"stop": [5]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(fields, name):
    with pytest.raises(TypeError, match=name) as info:
        SamplingParams(**fields)
    assert isinstance(info.value, ValueError)  # the HTTP layer and the CLI catch ValueError


def test_sampling_params_accept_their_whole_range():
    p = SamplingParams(
        max_tokens=2**31 - 1,
        temperature=2,
        top_k=-1,
        seed=-(2**63),
        stop="x",
        stop_token_ids=[0, 2**63 - 1],
    )
    assert p.stop == ("x",) and p.stop_token_ids == (0, 2**63 - 1)
    assert SamplingParams(stop=["s" * MAX_STOP_STRING_LENGTH] * MAX_STOP_STRINGS).stop
    with pytest.raises(dataclasses.FrozenInstanceError):  # no bypassing the checks later
        p.seed = 2**64
    with pytest.raises(ValueError, match="seed"):
        dataclasses.replace(p, seed=2**64)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


@pytest.mark.parametrize(
    "ids,match",
    [
        ([1.7, 5], r"prompt_ids\[0\] must be an integer"),
        ([5, "5"], r"prompt_ids\[1\] must be an integer"),
        ([5, 6, True], r"prompt_ids\[2\] must be an integer"),
        ("123", "prompt_ids must be a list"),
        (5, "prompt_ids must be a list"),
    ],
)
def test_prompt_ids_of_the_wrong_type_are_refused_not_coerced(engine, ids, match):
    with pytest.raises(ParameterTypeError, match=match):
        engine.add_request(prompt_ids=ids)
    assert not engine.has_unfinished


@pytest.mark.parametrize("bad", [-1, 512, 2**63, 2**64])  # synthetic:tiny has 512 ids
def test_prompt_ids_outside_the_vocabulary_are_refused(engine, bad):
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] = .* is not a token id"):
        engine.add_request(prompt_ids=[5, bad, 6])
    assert not engine.has_unfinished


def test_other_add_request_arguments_are_checked(engine):
    with pytest.raises(ParameterTypeError, match="params"):
        engine.add_request("hi", {"max_tokens": 5})
    with pytest.raises(ParameterTypeError, match="prompt must be a string"):
        engine.add_request(b"hi")
    with pytest.raises(ParameterTypeError, match="messages must be a list"):
        engine.add_request(messages={"role": "user", "content": "hi"})
    with pytest.raises(ParameterTypeError, match=r"messages\[0\] must be a dict"):
        engine.add_request(messages=["hi"])
    with pytest.raises(ValueError, match=r"messages\[1\] needs a 'role'"):
        engine.add_request(messages=[{"role": "user", "content": "hi"}, {"content": "x"}])
    with pytest.raises(ParameterTypeError, match=r"messages\[0\]\['content'\]"):
        engine.add_request(messages=[{"role": "user", "content": 5}])
    with pytest.raises(ParameterTypeError, match="request_id"):
        engine.add_request("hi", request_id=5)
    assert not engine.has_unfinished and engine.pool.num_used == 0


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": True}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"kv_cache_gib": 0}, "kv_cache_gib"),
        ({"kv_cache_gib": math.nan}, "kv_cache_gib"),
        ({"gpu_memory_fraction": math.inf}, "gpu_memory_fraction"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"max_queue": 0}, "max_queue"),
        ({"dtype": "int8"}, "dtype"),
        ({"backend": "gpu"}, "backend"),
        ({"device": "meta"}, "device"),
        ({"device": "cuda:x"}, "device"),
        ({"backend": "cuda", "device": "cpu"}, "device is cpu"),
        ({"backend": "cpu", "device": "cuda"}, "device is cuda"),
    ],
)
def test_bad_engine_config_is_a_value_error_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**fields)


def test_max_model_len_is_honoured(engine):
    assert make_engine(max_model_len=40).max_model_len == 40


# --- defect 7: unbounded stop strings -----------------------------------------------------------
def test_stop_strings_are_bounded_in_number_and_length():
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=[f"s{i}" for i in range(200_000)])
    with pytest.raises(ValueError, match=rf"stop\[0\] must have 1 to {MAX_STOP_STRING_LENGTH}"):
        SamplingParams(stop=["x" * 10_000])


# --- fuzz: whatever a client sends, a ValueError or a working request ---------------------------
ANY_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE, max_size=4))
def test_sampling_params_raise_only_value_errors(fields):
    try:
        p = SamplingParams(**fields)
    except ValueError as exc:  # ParameterTypeError included; anything else fails the test
        assert any(name in str(exc) for name in fields)  # it names a field it was given
        return
    assert type(p.max_tokens) is int and 1 <= p.max_tokens < 2**31
    assert type(p.top_k) is int and -(2**31) <= p.top_k < 2**31
    assert p.seed is None or (type(p.seed) is int and -(2**63) <= p.seed < 2**63)
    assert 0 <= p.temperature <= 2 and 0 < p.top_p <= 1 and type(p.ignore_eos) is bool
    assert all(type(s) is str for s in p.stop) and all(type(t) is int for t in p.stop_token_ids)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        st.integers(-5, 600) | st.integers(-(2**70), 2**70) | ANY_VALUE, min_size=1, max_size=6
    ),
    seed=st.integers(-(2**65), 2**65),
)
def test_any_prompt_ids_are_refused_or_served(engine, ids, seed):
    try:
        params = SamplingParams(max_tokens=2, seed=seed)
        request = engine.add_request(prompt_ids=ids, params=params)
    except ValueError:
        assert not engine.has_unfinished
        return
    outputs = [o for o in engine.run_until_done() if o.request_id == request.request_id]
    assert outputs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert engine.pool.num_used == 0


def test_without_chunked_prefill_a_prompt_over_the_step_budget_is_refused_not_queued():
    """Without chunked prefill a prompt runs in one step: one longer than the token budget is
    refused at once and the context ends at the budget (a preempted sequence's recompute
    fits one step too). Before, it sat at the queue's head forever and nobody behind it ran."""
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=16)
    assert engine.max_model_len == 16
    with pytest.raises(RequestRejected, match="16 tokens"):
        engine.add_request(prompt_ids=PROMPT, params=GREEDY)  # 24 > 16
    short = engine.add_request(
        prompt_ids=PROMPT[:5], params=dataclasses.replace(GREEDY, max_tokens=40)
    )
    outputs = run(engine)[short.request_id]
    assert len(ids_of(outputs)) == 16 - 5 and outputs[-1].finish_reason is FinishReason.CONTEXT


@pytest.mark.parametrize("form", ["prompt", "messages"])
def test_a_10_mb_prompt_is_refused_before_it_is_tokenized(form, monkeypatch):
    """Its characters prove it cannot fit the context (at least one token per
    Tokenizer.max_token_chars of them): refused without the seconds of tokenizing it, from
    Python, the CLI's stdin lines and HTTP alike."""
    engine = make_engine()
    tokenizer = engine.tokenizer
    assert tokenizer.max_token_chars is not None
    encoded: list[int] = []
    real_encode = tokenizer.encode

    def encode(text, *args, **kwargs):
        encoded.append(len(text))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    huge = "x" * 10_000_000
    args = (
        {"prompt": huge} if form == "prompt" else {"messages": [{"role": "user", "content": huge}]}
    )
    with pytest.raises(RequestRejected, match="at least .* tokens"):
        engine.add_request(params=GREEDY, **args)
    assert encoded == []
    # the bound's edge: (context - 1) tokens' worth of characters is tokenized (and may then be
    # refused by its real count); one character more is not
    edge = "x" * (tokenizer.max_token_chars * (engine.max_model_len - 1))
    with pytest.raises(RequestRejected, match="at least .* tokens"):
        engine.add_request(prompt=edge + "x", params=GREEDY)
    assert encoded == []
    try:
        engine.add_request(prompt=edge, params=GREEDY)
    except RequestRejected as exc:
        assert "prompt tokens leave no room" in str(exc)
    assert encoded == [len(edge)]


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(allowed_token_ids=[5, 6], bad_words=[[5], [6]]), "allowed_token_ids: bad_words ban"),
        (dict(bad_words=[[t] for t in range(512)]), "bad_words: bad_words ban every"),
        (dict(allowed_token_ids=[0, 2], min_tokens=3), "min_tokens: every token left"),
    ],
)
def test_parameters_that_leave_no_first_token_are_refused(fields, message):
    engine = make_engine()
    assert engine.vocab_size == 512 and engine.tokenizer.stop_token_ids == {0, 2}
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt_ids=PROMPT, params=SamplingParams(max_tokens=4, **fields))
    assert not engine.has_unfinished
    # one token left (or the stop tokens no longer masked) is a request like any other
    fine = dict(fields, allowed_token_ids=[5, 6, 7]) if "allowed_token_ids" in fields else {}
    engine.add_request(prompt_ids=PROMPT, params=SamplingParams(max_tokens=4, **(fine or {})))
    run(engine)


@pytest.mark.parametrize(
    "fields,named",
    [
        # a grammar whose every next token allowed_token_ids excludes
        (dict(response_format={"type": "json_object"}, allowed_token_ids=[90]),
         "response_format, allowed_token_ids"),
        # after either token, bad_words ban both
        (dict(allowed_token_ids=[20, 21], bad_words=[[20, 20], [20, 21], [21, 20], [21, 21]]),
         "allowed_token_ids, bad_words"),
    ],
)  # fmt: skip
def test_masks_that_leave_no_token_later_fail_the_request_alone(fields, named, solo):
    """Before: the samplers' fallback (token 0 when nothing is allowed) came out as a token,
    here the end-of-text id, so the request ended "stop" with an answer its grammar or bans
    forbid. Now it fails alone naming its fields; the neighbour gets what it gets alone."""
    engine = make_engine()
    bad = engine.add_request(prompt_ids=PROMPT, params=SamplingParams(max_tokens=6, **fields))
    other = engine.add_request(prompt_ids=OTHER, params=GREEDY)
    outputs = run(engine)
    last = outputs[bad.request_id][-1]
    assert last.finish_reason is FinishReason.ERROR
    assert bad.error.startswith(f"NoTokenAllowed: {named}: no token is allowed"), bad.error
    assert all(t in fields["allowed_token_ids"] for t in bad.output_ids)
    assert ids_of(outputs[other.request_id]) == solo


def test_a_closed_engine_refuses_steps_and_requests():
    """close() gives the KV cache and weights back on a GPU: an engine that kept stepping
    after it (before: it did, silently) would read freed memory."""
    from pagedkern.engine import LLM

    engine = make_engine()
    engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    run(engine)
    engine.close()
    engine.close()  # (idempotent)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.step()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.add_request(prompt_ids=PROMPT, params=GREEDY)
    llm = LLM("synthetic:tiny", backend="reference", num_blocks=64, block_size=4)
    llm.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate("hi", GREEDY)


def test_a_context_past_the_models_is_refused():
    """Before: max_model_len = 10**7 on a model of 2048 positions built two RoPE tables of 10**7
    rows (~1.3 GB) and ran prompts at positions the model was never trained for."""
    with pytest.raises(ValueError, match="max_model_len 4096 is past the model's context of 2048"):
        make_engine(max_model_len=4096)
    assert make_engine(max_model_len=2048, num_blocks=1024).max_model_len == 2048


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(prompt="a\ud800b"), "prompt: not text the tokenizer can take"),
        (dict(messages=[{"role": "user"}]), "messages: the chat template failed on them"),
    ],
)
def test_text_the_tokenizer_or_template_cannot_take_is_a_value_error(args, message):
    """Before: the tokenizers library's TypeError and jinja2's UndefinedError, naming nothing."""
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(params=GREEDY, **args)
    assert not engine.has_unfinished and engine.pool.num_used == 0
