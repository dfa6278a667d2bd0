"""Decode manager: the continuous batch of requests that feed one token per step."""

from __future__ import annotations

from pd_ssm.cache.manager import CacheManager
from pd_ssm.engine.request import Request
from pd_ssm.engine.schedule_types import ScheduledSeq


class DecodeManager:
    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.running: list[Request] = []  # oldest first

    def add(self, req: Request) -> None:
        self.running.append(req)

    def remove(self, req: Request) -> bool:
        if req in self.running:
            self.running.remove(req)
            return True
        return False

    def schedule_one(self, req: Request) -> ScheduledSeq | None:
        """Reserve room for the request's next token, or None if the blocks ran out."""
        return ScheduledSeq(req, 1) if self.cache.try_grow(req.req_id, req.num_tokens) else None
