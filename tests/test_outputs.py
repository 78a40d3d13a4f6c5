"""Output snapshots: RequestOutput.of / RequestMetrics.of build them without the frozen
dataclass __init__ (engine/outputs.py, _builder); they must be exactly what the constructor
makes, of the same class, and as frozen."""

from __future__ import annotations

import dataclasses

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
    for obj in (out, out.metrics):
        for f in dataclasses.fields(obj):
            assert getattr(obj, f.name) == getattr(expected if obj is out else metrics, f.name), (
                f.name
            )
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, f.name, None)
    request.output_ids.append(7)  # a snapshot does not see later tokens
    assert out.output_token_ids == (5, 6) and out.metrics.num_output_tokens == 2


def test_logprobs_default_to_empty_when_asked_for():
    out = RequestOutput.of(running_request(), "", (), False)
    assert out.logprobs == () and out.finish_reason is None
