"""RequestStream: one request's deltas on the router, from the worker(s) that run it.

Colocated, one worker sends every delta.  Disaggregated, two do: the prefill worker the first
token, the decode worker every later one -- over two sockets, so a decode worker's tokens can
overtake the first.  A stream with `first_from` set holds other workers' deltas until that
worker's first delta came (`accept`), so the client always sees tokens in order.  `workers` lists
every worker that holds a part of the request (the prefill worker until its pages have left, the
decode worker once it reserved): losing one of them fails the request, and when the request ends
they are told to drop it (workers.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pd_ssm.control.messages import TokenDelta


@dataclass(slots=True)
class StreamFailure:
    """Put on a request's queue when its worker is lost (the request ends with a 503), or when
    the router aborted it (`aborted`: the client is gone, nobody is told)."""

    message: str
    aborted: bool = False


@dataclass(slots=True)
class RequestStream:
    """One request's deltas as they come from its worker(s); the last one has a finish_reason."""

    req_id: str
    worker_id: str  # the worker it was submitted to (the prefill worker when disaggregated)
    queue: asyncio.Queue[TokenDelta | StreamFailure] = field(default_factory=asyncio.Queue)
    done: bool = False
    workers: set[str] = field(default_factory=set)  # workers holding a part of it
    first_from: str | None = None  # deltas of others wait until this worker's first one came
    held: list[TokenDelta] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers.add(self.worker_id)

    def accept(self, worker_id: str, delta: TokenDelta) -> list[TokenDelta]:
        """The deltas that may go to the client now, in order, given that `delta` came from `worker_id`."""
        if self.first_from is None:
            return [delta]
        if worker_id != self.first_from:
            self.held.append(delta)  # a later token overtook the first one: keep the order
            return []
        self.first_from = None
        ready, self.held = [delta, *self.held], []
        return ready
