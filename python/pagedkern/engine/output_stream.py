"""Engine.stream()'s iterator: one request's outputs (every sample's) as the engine's steps make
them, the other requests' set aside for the next step() (or another stream).

It knows its samples as the Request objects it admitted, not by their ids: an id is free again
once its request has finished, and a stream left suspended (a `break` out of its loop) must
not, when it is closed or collected later, cancel a new request that took the same id.
Closing it (also before its first output, also by garbage collection) cancels each of its
samples still running and drops its outputs no one has taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request


class OutputStream:
    def __init__(
        self,
        step: Callable[[], list[RequestOutput]],
        abort: Callable[..., RequestOutput | None],
        output: OutputProcessor,
        samples: Sequence[Request],
    ) -> None:
        """step, abort: the engine's; output: its OutputProcessor (the running requests and
        the outputs set aside); samples: the request's, as admitted."""
        self._step, self._abort, self._output = step, abort, output
        self._samples = tuple(samples)
        self._ids = frozenset(s.request_id for s in samples)
        self._cancelled = False
        self._outputs = self._generate()

    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def __next__(self) -> RequestOutput:
        return next(self._outputs)

    def __enter__(self) -> OutputStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Cancel what still runs of the request; its outputs not yet taken go too."""
        self._outputs.close()  # (a suspended generator runs its `finally`: _cancel)
        self._cancel()

    def _generate(self) -> Iterator[RequestOutput]:
        output = self._output
        try:
            while self._running() or any(self._ours(o) for o in output.undelivered):
                outputs = self._step()
                output.undelivered += [o for o in outputs if not self._ours(o)]
                yield from (o for o in outputs if self._ours(o))
        finally:
            self._cancel()

    def _ours(self, output: RequestOutput) -> bool:
        return output.request_id in self._ids

    def _running(self) -> list[Request]:
        """This stream's samples still running (the very objects: an id may be reused)."""
        requests = self._output.requests
        return [s for s in self._samples if requests.get(s.request_id) is s]

    def _cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        for sample in reversed(self._running()):  # (the first last: it ends unforked samples)
            self._abort(sample.request_id, alone=True)
        # its ids that no other request holds now (a finished sample's may be taken again)
        output = self._output
        mine = {s.request_id for s in self._samples if output.requests.get(s.request_id, s) is s}
        output.undelivered = [o for o in output.undelivered if o.request_id not in mine]
