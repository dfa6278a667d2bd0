"""Routing policies: which healthy worker takes the next request.  Pure: no sockets, no clocks.

Every policy sees the same snapshot (`WorkerView`, one per worker in rotation, never empty) and
returns one of them.  Load is `max(inflight, running + waiting)`: the router's own count of
requests it sent and has not seen finish is current, a worker's report is up to one health
interval old, and each can run ahead of the other.  Ties go to more free pages (state slots, then
KV blocks), then to the smaller worker id, so a choice is reproducible.

Chosen by name (`make_policy`): round_robin, least_loaded, power_of_two.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    inflight: int = 0  # requests the router sent to it that have not finished
    running: int = 0  # as last reported by the worker
    waiting: int = 0
    free_slots: int = 0
    free_blocks: int = 0

    @property
    def load(self) -> int:
        return max(self.inflight, self.running + self.waiting)


def load_key(w: WorkerView) -> tuple[int, int, int, str]:
    """Sort key: lower is the better choice."""
    return (w.load, -w.free_slots, -w.free_blocks, w.worker_id)


class RoutingPolicy(ABC):
    """Picks a worker for one request.  Contract: `workers` is non-empty and each id appears once;
    the result is one of them.  A policy may keep state between calls (round robin's position)."""

    name: ClassVar[str]

    @abstractmethod
    def choose(self, workers: Sequence[WorkerView]) -> WorkerView: ...

    @staticmethod
    def _check(workers: Sequence[WorkerView]) -> None:
        if not workers:
            raise ValueError("no worker to choose from: the caller answers 503 before asking a policy")


class RoundRobin(RoutingPolicy):
    """Cycles through worker ids in sorted order; a worker that leaves or joins rotation shifts
    nothing else (the next pick is the first id after the last one picked)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, workers: Sequence[WorkerView]) -> WorkerView:
        self._check(workers)
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = ordered[0]
        if self._last is not None:
            pick = next((w for w in ordered if w.worker_id > self._last), ordered[0])
        self._last = pick.worker_id
        return pick


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def choose(self, workers: Sequence[WorkerView]) -> WorkerView:
        self._check(workers)
        return min(workers, key=load_key)


class PowerOfTwo(RoutingPolicy):
    """Two workers drawn at random, the less loaded of them: near least-loaded balance without
    every router herding onto the same worker between load reports."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: Sequence[WorkerView]) -> WorkerView:
        self._check(workers)
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return min(a, b, key=load_key)


POLICIES: dict[str, Callable[[random.Random | None], RoutingPolicy]] = {
    RoundRobin.name: lambda rng: RoundRobin(),
    LeastLoaded.name: lambda rng: LeastLoaded(),
    PowerOfTwo.name: lambda rng: PowerOfTwo(rng),
}


def make_policy(name: str, rng: random.Random | None = None) -> RoutingPolicy:
    try:
        return POLICIES[name](rng)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
