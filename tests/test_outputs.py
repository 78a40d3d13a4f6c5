"""Output snapshots: RequestOutput.of builds one with a single tuple.__new__ and its metrics
only when read (engine/outputs.py); it must be exactly what the constructor makes, of the same
class, and as frozen as the RequestMetrics dataclass."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedkern.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from pagedkern.engine.request import FinishReason, Request
from pagedkern.engine.sampling_params import SamplingParams


def running_request() -> Request:
    request = Request("R7", [1, 2, 3], SamplingParams(logprobs=2), arrival_time=1.0)
    request.output_ids += [5, 6]
    request.token_times += [2.0, 2.5]
    request.first_token_time = 2.0
    request.num_cached_tokens, request.num_preemptions = 16, 1
    return request


def test_snapshots_equal_the_constructors_and_are_frozen():
    request = running_request()
    logprobs = (TokenLogprob(6, -0.5, ((6, -0.5), (5, -1.0))),)
    out = RequestOutput.of(request, "ab", (6,), True, FinishReason.LENGTH, logprobs)
    metrics = RequestMetrics(1.0, 2.0, None, 3, 2, 16, 1, request.token_times)
    expected = RequestOutput(
        "R7", "ab", (6,), True, FinishReason.LENGTH, (1, 2, 3), metrics, None,
        request.output_ids, logprobs, 0, None,
    )  # fmt: skip
    assert type(out) is RequestOutput and type(out.metrics) is RequestMetrics
    assert out == expected and out.metrics == metrics
    assert out.output_token_ids == (5, 6) and out.metrics.itl == (0.5,)
    names = [
        (out, RequestOutput.FIELDS),
        (out.metrics, [f.name for f in dataclasses.fields(metrics)]),
    ]
    for obj, fields in names:
        for name in fields:
            assert getattr(obj, name) == getattr(expected if obj is out else metrics, name), name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, name, None)
    request.output_ids.append(7)  # a snapshot does not see later tokens
    assert out.output_token_ids == (5, 6) and out.metrics.num_output_tokens == 2


def test_metrics_are_a_snapshot_though_built_on_read():
    request = running_request()
    out = RequestOutput.of(request, "", (6,), False)
    request.num_preemptions, request.num_cached_tokens = 2, 0  # preempted after this output
    request.token_times.append(3.0)
    request.output_ids.append(7)
    request.finish_time = 4.0
    m = out.metrics
    assert (m.num_preemptions, m.num_cached_tokens, m.finish_time) == (1, 16, None)
    assert m.token_times == (2.0, 2.5) and m.tpot == 0.5 and m.num_prompt_tokens == 3
    assert "R7" in repr(out) and "_output_ids" not in repr(out)


def test_outputs_pickle_and_compare_by_value():
    out = RequestOutput.of(running_request(), "ab", (6,), True, FinishReason.LENGTH)
    again = pickle.loads(pickle.dumps(out))
    assert type(again) is RequestOutput and again == out and again.metrics == out.metrics
    assert out != RequestOutput.of(running_request(), "ab", (6,), False)


def test_logprobs_default_to_empty_when_asked_for():
    out = RequestOutput.of(running_request(), "", (), False)
    assert out.logprobs == () and out.finish_reason is None
