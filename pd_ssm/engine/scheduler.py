"""The step scheduler, composed of a prefill manager and a decode manager over one CacheManager.

Order of work in a step: decodes first (one token each, latency-critical), then prefill chunks in
the remaining token budget.  When a decode cannot get a block, the newest request holding cache
is preempted by recompute: its slot and blocks are freed and it goes back to the front of the
waiting queue with `num_computed_tokens = 0`, to be prefilled again over prompt + outputs.  The
cache is never overwritten under a live request, so preemption changes timing, not tokens.

A role that lacks one manager (a prefill worker has no decodes, a decode worker no prefills)
passes None; the scheduler has no role flags.
"""

from __future__ import annotations

from pd_ssm.cache.manager import CacheManager
from pd_ssm.config import SchedulerConfig
from pd_ssm.engine.decode_manager import DecodeManager
from pd_ssm.engine.prefill_manager import PrefillManager
from pd_ssm.engine.request import Request, Status
from pd_ssm.engine.schedule_types import ScheduledSeq, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        prefill: PrefillManager | None,
        decode: DecodeManager | None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.prefill = prefill
        self.decode = decode
        self._admit_order: dict[str, int] = {}
        self._next_order = 0

    # --- membership ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.prefill is None:
            raise RuntimeError("this engine has no prefill manager: requests arrive with their state")
        self.prefill.add(req)

    def add_decoding(self, req: Request) -> None:
        """Join the decode batch: a request whose prefill just finished, or one imported."""
        if self.decode is None:
            raise RuntimeError("this engine has no decode manager")
        self._order(req)
        req.status = Status.RUNNING
        self.decode.add(req)

    def finish_prefill(self, req: Request) -> None:
        """The request's prefill is done; it leaves the prefill manager (cache still held)."""
        assert self.prefill is not None
        self.prefill.prefilling.remove(req)

    def release(self, req: Request) -> None:
        """Forget the request wherever it is and free its cache (finish, abort, export)."""
        for mgr in (self.prefill, self.decode):
            if mgr is not None:
                mgr.remove(req)
        self.cache.free(req.req_id)
        self._admit_order.pop(req.req_id, None)

    @property
    def num_running(self) -> int:
        n = len(self.prefill.prefilling) if self.prefill else 0
        return n + (len(self.decode.running) if self.decode else 0)

    @property
    def num_waiting(self) -> int:
        return len(self.prefill.waiting) if self.prefill else 0

    def has_work(self) -> bool:
        return self.num_running > 0 or self.num_waiting > 0

    # --- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.decode is not None:
            for req in list(self.decode.running):
                if budget <= 0:
                    break
                # preempted earlier in this loop, finished while a step was in flight, or done
                # once the step in flight is read (async scheduling)
                if req.status is not Status.RUNNING or req.last_token_in_flight:
                    continue
                seq = self._schedule_decode(req, out)
                if seq is not None:
                    out.decodes.append(seq)
                    budget -= 1
        if self.prefill is not None:
            room = self.config.max_num_seqs - self.num_running
            out.prefills = self.prefill.schedule(budget, room)
            for seq in out.prefills:
                self._order(seq.request)
            if out.empty and self.prefill.prefilling:
                # Every running prefill is blocked on KV blocks held by the others: free the
                # newest so the oldest can move on (bounded: each round frees one request).
                while out.empty and len(self.prefill.prefilling) > 1:
                    self._preempt(self._newest(self.prefill.prefilling), out)
                    out.prefills = self.prefill.schedule(budget, room)
        return out

    def _schedule_decode(self, req: Request, out: SchedulerOutput) -> ScheduledSeq | None:
        assert self.decode is not None
        while True:
            seq = self.decode.schedule_one(req)
            if seq is not None:
                return seq
            scheduled = {s.request.req_id for s in out.decodes}
            candidates = [r for r in self._holders() if r.req_id not in scheduled]
            victim = self._newest(candidates)
            self._preempt(victim, out)
            if victim is req:
                return None

    def _holders(self) -> list[Request]:
        held = list(self.decode.running) if self.decode else []
        return held + (list(self.prefill.prefilling) if self.prefill else [])

    def _newest(self, reqs: list[Request]) -> Request:
        return max(reqs, key=lambda r: self._admit_order.get(r.req_id, -1))

    def _order(self, req: Request) -> None:
        if req.req_id not in self._admit_order:
            self._admit_order[req.req_id] = self._next_order
            self._next_order += 1

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if self.prefill is None:
            # A decode-only engine cannot recompute: the request fails rather than corrupt state.
            self.release(req)
            req.finish("error", "preempted: no KV blocks left on a decode-only worker")
            out.preempted.append(req)
            return
        self.release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.prefill.requeue_front(req)
        out.preempted.append(req)
