"""EngineWorker: one Engine driven by the router's control messages (colocated, or in a
prefill / decode role composed in: role.py).

The loop is single-threaded (the engine is not thread-safe): drain every command that arrived,
run one engine step when there is work, send that step's token deltas as one StepOutputs.  With
no work it blocks on the command socket for at most `idle_poll_ms`, so an idle worker costs no CPU
and a new request waits at most one step (never an idle period) to be admitted.

Failure contract: a request the engine refuses (RequestError) ends alone with an "error" delta;
any other exception is fatal: the worker sends WorkerError(fatal=True) on a best-effort basis and
re-raises, so its process exits non-zero and the launcher reports it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from pd_ssm.control.messages import (
    TO_ROUTER,
    TO_WORKER,
    AbortRequest,
    HealthCheck,
    LoadReport,
    Shutdown,
    StepOutputs,
    SubmitRequest,
    TokenDelta,
    WorkerError,
    WorkerHello,
)
from pd_ssm.control.queues import PullQueue, PushQueue
from pd_ssm.engine.engine import Engine, RequestError
from pd_ssm.outputs import RequestOutput
from pd_ssm.worker.role import WorkerRole

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerConfig:
    worker_id: str
    router_address: str  # the router's PULL socket, e.g. "tcp://127.0.0.1:41233"
    host: str = "127.0.0.1"  # interface the worker's command socket binds on
    model_name: str = ""  # what the worker reports in its hello (the served model name)
    idle_poll_ms: int = 50
    # the launcher's pid: when it is gone (killed without a chance to stop us) the worker exits
    # instead of holding its device forever; None: no such check
    parent_pid: int | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("WorkerConfig.worker_id is empty: the router tells workers apart by it")
        if not self.router_address.startswith("tcp://"):
            raise ValueError(f"router_address must be tcp://HOST:PORT, got {self.router_address!r}")
        if self.idle_poll_ms <= 0:
            raise ValueError(f"idle_poll_ms must be > 0, got {self.idle_poll_ms}")


def delta_from_output(out: RequestOutput) -> TokenDelta:
    comp = out.outputs[0]
    return TokenDelta(
        req_id=out.request_id,
        token_ids=list(out.new_token_ids),
        text=out.new_text,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(comp.token_ids),
        finish_reason=comp.finish_reason,
        stop_reason=comp.stop_reason,
    )


class EngineWorker:
    def __init__(
        self, engine: Engine, config: WorkerConfig, ctx: zmq.Context | None = None, role: WorkerRole | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.role = role
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self.commands = PullQueue(self._ctx, config.host, TO_WORKER)
        self.to_router = PushQueue(self._ctx, config.router_address, TO_ROUTER)
        self._running = True  # until Shutdown or stop()
        self._steps = 0

    def run(self) -> None:
        """Serve until Shutdown; exceptions other than a refused request propagate (see module doc)."""
        cfg = self.config
        role = self.role
        self.to_router.send(WorkerHello(cfg.worker_id, self.commands.address, os.getpid(), cfg.model_name,
                                        self.engine.max_model_len, role.name if role else "colocated"))
        self._send_load(-1)
        try:
            if role is not None:
                role.start(self.to_router.send)
            while self._running:
                busy = self.engine.has_unfinished()
                # NOTE: transfers in flight progress only in this loop: then wait 1 ms, never idle_poll_ms
                wait = 1 if role is not None and role.pending() else cfg.idle_poll_ms
                if busy or self.commands.poll(wait):
                    self._drain_commands()
                if self._running and role is not None and role.progress():
                    self._send_load(-1)
                if self._running and self.engine.has_unfinished():
                    self._step()
                elif cfg.parent_pid is not None and os.getppid() != cfg.parent_pid:
                    log.error("worker %s: the launcher (pid %d) is gone; exiting", cfg.worker_id, cfg.parent_pid)
                    self._running = False
        except BaseException as e:
            self._report_fatal(e)
            raise
        finally:
            self.close()

    def stop(self) -> None:
        """Leave the loop after the current step (safe from a signal handler: it only sets a flag)."""
        self._running = False

    def close(self) -> None:
        if self.role is not None:
            self.role.close()
        self.commands.close()
        self.to_router.close()
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    # --- commands ------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while self._running:
            msg = self.commands.recv_nowait()
            if msg is None:
                return
            if self.role is not None and self.role.handle(msg):
                if isinstance(msg, AbortRequest):
                    self._send_load(-1)
                continue
            if isinstance(msg, SubmitRequest):
                self._submit(msg)
            elif isinstance(msg, AbortRequest):
                if self.engine.abort(msg.req_id) is not None:
                    self._send_load(-1)  # the pages are free now: let the router see it at once
            elif isinstance(msg, HealthCheck):
                self._send_load(msg.seq)
            elif isinstance(msg, Shutdown):
                log.info("worker %s: shutdown (%s)", self.config.worker_id, msg.reason or "asked by the router")
                for req_id in list(self.engine.requests):
                    self.engine.abort(req_id)
                self._running = False
            else:
                log.warning("worker %s: %s is not a command of this role; ignored", self.config.worker_id,
                            type(msg).__name__)

    def _submit(self, msg: SubmitRequest) -> None:
        try:
            req = self.engine.add_request(msg.prompt_token_ids, msg.params, request_id=msg.req_id)
        except RequestError as e:  # refused before anything was allocated: only this request fails
            delta = TokenDelta(msg.req_id, [], "", len(msg.prompt_token_ids), 0, finish_reason="error", error=str(e))
            self.to_router.send(StepOutputs(self.config.worker_id, [delta]))
            return
        log.debug("worker %s admitted %s (%d prompt tokens)", self.config.worker_id, req.req_id,
                  req.num_prompt_tokens)

    # --- the step ------------------------------------------------------------------------
    def _step(self) -> None:
        outs = self.engine.step()
        self._steps += 1
        if any(o.finished for o in outs):
            # pages were freed; reported before the deltas, so that by the time the router sees a
            # request finish, its view of the pools (and /metrics) already shows them free
            self._send_load(-1)
        if outs:
            make = self.role.delta if self.role is not None else delta_from_output
            self.to_router.send(StepOutputs(self.config.worker_id, [make(o) for o in outs]))

    def _send_load(self, seq: int) -> None:
        report = load_report(self.engine, self.config.worker_id, seq, self._steps)
        if self.role is not None:
            report.reserved, report.transfers = self.role.reserved, self.role.transfers
            report.waiting += self.role.queued
        self.to_router.send(report)

    def _report_fatal(self, e: BaseException) -> None:
        if isinstance(e, KeyboardInterrupt | SystemExit):
            return  # asked to stop: the launcher knows, nothing failed
        try:
            self.to_router.send(WorkerError(self.config.worker_id, f"{type(e).__name__}: {e}", fatal=True),
                                block=False)
            time.sleep(0.05)  # LINGER is 0: give the message a moment to leave before the process dies
        except Exception:  # the router may be gone as well; the exit code still tells the launcher
            log.exception("worker %s could not report its failure", self.config.worker_id)


def load_report(engine: Engine, worker_id: str, seq: int, steps: int) -> LoadReport:
    cache = engine.cache
    ok = (cache.num_free_slots + cache.num_used_slots == cache.num_slots
          and cache.num_free_blocks + cache.num_used_blocks == cache.num_blocks)
    try:
        cache.check()
    except AssertionError:
        ok = False
    sched = engine.scheduler
    return LoadReport(
        worker_id=worker_id, seq=seq, running=sched.num_running, waiting=sched.num_waiting,
        free_slots=cache.num_free_slots, used_slots=cache.num_used_slots,
        free_blocks=cache.num_free_blocks, used_blocks=cache.num_used_blocks, pool_ok=ok, steps=steps,
    )
