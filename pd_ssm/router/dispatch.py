"""Dispatcher: route one request to a worker, stream its deltas back, time it, abort it.

The one place where a request's life on the router is decided: the policy picks among workers in
rotation (none: 503), deltas are yielded as they arrive, the end is observed in the metrics, and
a request whose consumer stops early (client gone, error) is aborted on its worker so its pages
are freed at once.  A lost worker ends the request with a 503; a request its worker refused ends
with a 400 carrying the engine's message.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pd_ssm.control.messages import TokenDelta
from pd_ssm.router.errors import APIError
from pd_ssm.router.metrics import RouterMetrics
from pd_ssm.router.policies import RoutingPolicy
from pd_ssm.router.streams import RequestStream, StreamFailure
from pd_ssm.router.workers import NoWorkerError, WorkerPool
from pd_ssm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Completion:
    """A finished request, gathered from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: TokenDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.prompt_tokens, self.completion_tokens = delta.prompt_tokens, delta.completion_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class Submitted:
    stream: RequestStream
    prompt_tokens: int
    sent_at: float  # monotonic seconds


class Dispatcher:
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, prefix: str = "cmpl") -> Submitted:
        views = [w.view() for w in self.pool.in_rotation()]
        if not views:
            raise APIError(503, "no engine worker is available right now; retry shortly (see GET /health)")
        worker = self.policy.choose(views)
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = self.pool.submit(worker.worker_id, req_id, prompt_token_ids, params)
        except NoWorkerError as e:
            raise APIError(503, f"could not reach an engine worker: {e}") from e
        log.debug("%s -> worker %s", req_id, worker.worker_id)
        return Submitted(stream, len(prompt_token_ids), time.monotonic())

    def abort(self, sub: Submitted) -> None:
        """Free the request on its worker and wake whoever is reading its stream."""
        if not sub.stream.done:
            self.pool.abort(sub.stream.req_id)
            sub.stream.queue.put_nowait(StreamFailure("aborted: the client went away", aborted=True))
            self.metrics.requests.labels("abort").inc()

    async def deltas(self, sub: Submitted) -> AsyncIterator[TokenDelta]:
        """Every delta of the request, the last one finished; raises APIError (400 refused by the
        worker, 503 worker lost).  Leaving early aborts the request on its worker."""
        first: float | None = None
        try:
            while True:
                item = await sub.stream.queue.get()
                if isinstance(item, StreamFailure):
                    if not item.aborted:
                        self.metrics.requests.labels("error").inc()
                    raise APIError(503, item.message)
                if item.finish_reason == "error":
                    self.metrics.requests.labels("error").inc()
                    raise APIError(400, item.error or "the engine refused the request", "prompt")
                if first is None and item.token_ids:
                    first = time.monotonic()
                yield item
                if item.finished:
                    self.metrics.observe_finished(
                        ttft=None if first is None else first - sub.sent_at, e2e=time.monotonic() - sub.sent_at,
                        prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens,
                        finish_reason=item.finish_reason or "",
                    )
                    return
        finally:
            self.abort(sub)  # no-op when it finished; frees the worker's pages otherwise

    async def collect(self, sub: Submitted) -> Completion:
        done = Completion(prompt_tokens=sub.prompt_tokens)
        async for delta in self.deltas(sub):
            done.add(delta)
        return done
