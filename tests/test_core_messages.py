"""The typed messages between the HTTP front end and the engine core (serving/core/messages.py):
every message survives its wire form unchanged, SamplingParams cross without their checks
re-run but with the core's bounds, and a core survives a frame that is not a message."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing

import pytest
from http_stack import *  # noqa: F403  (skips without the server's stack)
from test_http_server import tiny_engine

from pagedkern.engine import SamplingParams
from pagedkern.engine.outputs import TokenLogprob
from pagedkern.serving.core import channel
from pagedkern.serving.core.channel import Channel
from pagedkern.serving.core.engine_core import EngineCore
from pagedkern.serving.core.messages import (
    BY_TAG,
    Abort,
    Add,
    Added,
    AddRequest,
    CoreInfo,
    Dead,
    EngineGauges,
    Failed,
    Ready,
    Refused,
    SampleDelta,
    Stats,
    StatsQuery,
    StepOutputs,
    Stop,
    params_from_wire,
    params_to_wire,
)

FULL_PARAMS = SamplingParams(
    max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=-3, stop_token_ids=[4, 5],
    ignore_eos=True, timeout=3.5, presence_penalty=0.5, frequency_penalty=-0.5,
    repetition_penalty=1.2, logit_bias={7: 1.5, "8": -2}, allowed_token_ids=[1, 2, 7, 8],
    bad_words=[[3], [4, 5]], min_p=0.1, min_tokens=2, logprobs=3, prompt_logprobs=1, n=2,
    response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
)  # fmt: skip
NAMES = [f.name for f in dataclasses.fields(SamplingParams)]


def fields(params: SamplingParams) -> dict:
    """The fields but `stop` (dataclasses.replace would check a normalised response_format
    again, which takes only the API's form)."""
    return {name: getattr(params, name) for name in NAMES if name != "stop"}


LP = TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.5)))
MESSAGES = [
    Add([AddRequest("a", [1, 2, 3], FULL_PARAMS), AddRequest("b", [4], SamplingParams())]),
    Abort("a.1"),
    Abort("a", True),
    StatsQuery(3),
    Stop(),
    Ready(CoreInfo("synthetic:tiny", 64, 256, 8, "a model")),
    Failed("no such model"),
    Added("a", 3),
    Refused("b", "queue_full", "9 requests are already waiting"),
    StepOutputs(
        [
            SampleDelta("a", 1, [5], "stop", None, (LP,)),
            SampleDelta("b", 0, [6, 7], None, "boom", None, [1, 2], (None, LP)),
        ],
        ["c", "d"],
        [8, 9],
    ),
    StepOutputs([], [], []),  # a heartbeat
    Stats(3, EngineGauges(1, 2, 3, 4, 5, 6, 7, [["norm", 0, 1, 0.5, 0]])),
    Dead("the server is shutting down", EngineGauges(0, 0, 0, 16)),
    Dead("broken", None),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_the_wire_unchanged(message):
    data = channel.encode(message)
    assert channel.decode(data) == message
    assert channel.unpack(data)[0] == message.TAG


def test_every_message_type_has_its_own_tag():
    assert sorted(BY_TAG) == sorted({cls.TAG for cls in BY_TAG.values()})
    assert len(BY_TAG) == 11


def test_sampling_params_cross_as_they_were_checked_but_without_stop_strings():
    params = FULL_PARAMS
    back = params_from_wire(channel.unpack(channel.pack(params_to_wire(params))))
    assert fields(back) == fields(params) and back.stop == ()
    with_stop = SamplingParams(stop=["zz"], logit_bias={1: 2})
    assert params_from_wire(params_to_wire(with_stop)) == SamplingParams(logit_bias={1: 2})
    assert isinstance(back.stop_token_ids, tuple) and isinstance(back.bad_words[1], tuple)
    with pytest.raises(TypeError):  # still read-only, as SamplingParams keeps it
        back.logit_bias[7] = 0.0
    assert params_from_wire(params_to_wire(SamplingParams())) == SamplingParams()


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 10_000), ("logprobs", 10_000), ("max_tokens", 0), ("min_tokens", 99),
     ("bad_words", [[]]), ("allowed_token_ids", list(range(70_000))), ("n", "2"),
     ("temperature", "hot"), ("top_p", float("nan")), ("seed", 2**64 - 1), ("top_k", 1.5),
     ("ignore_eos", 1)],
)  # fmt: skip
def test_the_core_refuses_parameters_out_of_its_bounds_alone(field, value):
    """A frame whose parameters could blow up the core's work or buffers (what a broken front
    end could send: nothing the front end's checks let through) is refused, its neighbour in
    the same Add admitted."""
    values = params_to_wire(SamplingParams(max_tokens=4))
    values[NAMES.index(field)] = value
    frame = [Add.TAG, [["bad", [1, 2], values], ["good", [1, 2], params_to_wire(FULL_PARAMS)]]]
    bad, good = channel.decode(channel.pack(frame)).requests
    assert bad.params is None and field in bad.invalid
    assert fields(good.params) == fields(FULL_PARAMS)


def test_a_frame_that_is_no_message_is_a_value_error():
    for frame in ([], ["nope"], [Abort.TAG], [Stats.TAG, 1, [1, 2]], 5):
        with pytest.raises(ValueError):
            channel.decode(channel.pack(frame))


def test_the_core_survives_frames_that_are_not_messages():
    """Garbage on the channel is logged and dropped; the next request is served."""
    front, back = multiprocessing.Pipe()
    core = EngineCore(tiny_engine(), Channel(back))

    async def scenario():
        loop = asyncio.get_running_loop()
        task = loop.run_in_executor(None, core.run)
        front.send_bytes(b"\xc1")  # not msgpack
        front.send_bytes(channel.pack(["nope", 1]))
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        front.send_bytes(channel.encode(Add([AddRequest("r", [1, 2], params)])))
        got = []
        while not any(isinstance(m, StepOutputs) and m.outputs and m.outputs[-1].finish
                      for m in got):  # fmt: skip
            got.append(await loop.run_in_executor(None, lambda: channel.decode(front.recv_bytes())))
        front.send_bytes(channel.encode(Stop()))
        await task
        return got

    got = asyncio.run(scenario())
    assert got[0] == Added("r", 2)
