"""The front end's outbox to the engine core (serving/core/core_outbox.py): a burst of adds goes
out as one Add; an add that cannot be encoded (a field msgpack cannot carry) is refused to its
client alone, and the others in its burst still reach the core."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("msgpack")

from pagedkern.engine import SamplingParams  # noqa: E402
from pagedkern.serving.core import channel  # noqa: E402
from pagedkern.serving.core.core_outbox import CoreOutbox  # noqa: E402
from pagedkern.serving.core.messages import Add, AddRequest  # noqa: E402


class _Wire:
    """A Channel's send side that keeps the frames it is given."""

    def __init__(self):
        self.frames: list[bytes] = []

    def send_frame(self, data: bytes) -> None:
        self.frames.append(data)


def _unsendable_params() -> SamplingParams:
    """Parameters holding an integer past 64 bits: what the front end's checks refuse, made
    here past them (as a future field could carry one)."""
    schema = {"type": "integer", "maximum": 2**64}
    return _with(
        SamplingParams(max_tokens=3), response_format={"type": "json_schema", "schema": schema}
    )


def _with(params: SamplingParams, **fields) -> SamplingParams:
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _flush(adds: list[AddRequest]) -> tuple[list, list]:
    wire, refused = _Wire(), []
    outbox = CoreOutbox(wire, lambda request_id, why: refused.append((request_id, why)))

    async def burst():
        outbox.attach(asyncio.get_running_loop())
        for add in adds:
            outbox.add(add)
        await asyncio.sleep(0)  # the loop iteration's flush

    asyncio.run(burst())
    sent = [channel.decode(frame) for frame in wire.frames]
    return sent, refused


def test_a_burst_of_adds_goes_out_as_one_add():
    sent, refused = _flush([AddRequest(f"r{i}", [1, 2], SamplingParams()) for i in range(3)])
    assert refused == [] and len(sent) == 1 and isinstance(sent[0], Add)
    assert [r.request_id for r in sent[0].requests] == ["r0", "r1", "r2"]


def test_an_add_that_cannot_be_encoded_is_refused_alone():
    bad = AddRequest("bad", [1, 2], _unsendable_params())
    with pytest.raises(OverflowError):
        channel.encode(Add([bad]))
    adds = [AddRequest("a", [1], SamplingParams()), bad, AddRequest("b", [3], SamplingParams())]
    sent, refused = _flush(adds)
    assert [r.request_id for m in sent for r in m.requests] == ["a", "b"]
    assert [request_id for request_id, _ in refused] == ["bad"]
    assert "cannot be sent to the engine" in refused[0][1]
