"""Prefill manager: admission (FCFS), chunking, varlen batching of prompt chunks.

It owns the waiting queue and the requests that hold cache but still have more than one token
to feed.  Each step it continues those first (oldest first), then admits waiting requests while
the token budget, the sequence cap and the cache allow.  A chunk is shrunk to what the request's
blocks plus the free blocks can hold; admission is strictly FCFS (no overtaking), so a long prompt
cannot be starved by short ones behind it.
"""

from __future__ import annotations

from collections import deque

from pd_ssm.cache.manager import CacheManager
from pd_ssm.engine.request import Request, Status
from pd_ssm.engine.schedule_types import ScheduledSeq


class PrefillManager:
    def __init__(self, cache: CacheManager, chunked: bool = True) -> None:
        self.cache = cache
        self.chunked = chunked
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requeue_front(self, req: Request) -> None:
        """A preempted request goes back first in line (it was admitted before the others)."""
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> bool:
        if req in self.prefilling:
            self.prefilling.remove(req)
            return True
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        return False

    def schedule(self, budget: int, admit_room: int) -> list[ScheduledSeq]:
        """Chunks for this step within `budget` tokens, admitting at most `admit_room` requests."""
        out: list[ScheduledSeq] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = self._fit(req, min(req.num_pending_tokens, budget))
            if n == 0 or (not self.chunked and n < req.num_pending_tokens):
                continue
            self.cache.grow(req.req_id, req.num_computed_tokens + n)
            out.append(ScheduledSeq(req, n))
            budget -= n
        while self.waiting and budget > 0 and admit_room > 0:
            req = self.waiting[0]
            n = min(req.num_pending_tokens, budget)
            if not self.chunked and n < req.num_pending_tokens:
                break
            # admit for the first chunk only; later chunks grow (or shrink to) what is free
            n = min(n, self._admittable_tokens(req))
            if n <= 0 or not self.cache.can_admit(req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.cache.allocate(req.req_id, req.num_computed_tokens + n)
            req.status = Status.RUNNING
            self.prefilling.append(req)
            out.append(ScheduledSeq(req, n))
            budget -= n
            admit_room -= 1
        return out

    def _fit(self, req: Request, n: int) -> int:
        """Shrink a chunk to the tokens the request's blocks plus the free blocks can hold."""
        if not self.cache.uses_kv:
            return n
        bs = self.cache.block_size
        capacity = (len(self.cache.block_table(req.req_id)) + self.cache.num_free_blocks) * bs
        return max(0, min(n, capacity - req.num_computed_tokens))

    def _admittable_tokens(self, req: Request) -> int:
        if not self.cache.uses_kv:
            return req.num_pending_tokens
        return self.cache.num_free_blocks * self.cache.block_size - req.num_computed_tokens
