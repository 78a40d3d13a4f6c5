"""Preemption by recompute: who gives its KV blocks back when a running request needs a block
and none is free, and where it waits. Its blocks go back to the pool and it later recomputes
its K/V from its ids, so every admitted request eventually finishes.

Fairness rule: the victim is the newest sample of the request running the most samples (a
fan-out pays for its own growth, and re-queues behind those already waiting), else the newest
running request (back to the front of the queue). So short requests beside a large n > 1
request keep moving instead of being the ones preempted over and over.
"""

from __future__ import annotations

from collections import Counter, deque

from .request import Request


def preemption_victim(running: list[Request]) -> Request:
    """The newest running sample of the request that runs the most samples (an n > 1 request
    pays for its own fan-out), else the newest running request."""
    counts = Counter(r.parent_id for r in running if r.parent_id is not None)
    if counts:
        parent, count = counts.most_common(1)[0]
        if count > 1:
            return next(r for r in reversed(running) if r.parent_id == parent)
    return running[-1]


def requeue_preempted(waiting: deque[Request], request: Request) -> None:
    """A single request goes to the front (next to be readmitted), a sample of a fan-out
    behind the requests already waiting."""
    if request.parent_id is None:
        waiting.appendleft(request)
    else:
        waiting.append(request)
